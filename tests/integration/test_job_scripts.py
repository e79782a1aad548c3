"""The shipped jobqueue job scripts, rendered as `python -m infra.cluster_specs jobqueue`
renders them: rendering starts dask-jobqueue's scheduler in this process (on 127.0.0.1),
which is why these live here and not with the other infra/ checks in tests/unit."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
INFRA = Path(__file__).resolve().parents[2] / "infra"


@pytest.mark.parametrize("example", ["slurm-gpu.json", "pbs-gpu.json"])
def test_the_shipped_job_scripts_carry_tls(example: str, tmp_path: Path) -> None:
    """Renders the script as `python -m infra.cluster_specs jobqueue` does; the scheduler
    that rendering starts in this process binds 127.0.0.1, and the throwaway certificates go to
    tmp_path instead of $HOME."""
    from infra.cluster_specs import job_script

    options = json.loads((INFRA / "jobqueue" / example).read_text())
    assert options["security"] is True
    options |= {"shared_temp_directory": str(tmp_path), "scheduler_options": {"host": "127.0.0.1"}}
    worker = job_script(options).splitlines()[-1].split()
    assert worker[3].startswith("tls://127.0.0.1:"), worker
    assert worker[worker.index("--protocol") + 1] == "tls://"
    for flag in ("--tls-ca-file", "--tls-cert", "--tls-key"):
        assert worker[worker.index(flag) + 1].startswith(str(tmp_path)), flag


def test_a_job_script_puts_nccls_bootstrap_on_the_workers_interface(tmp_path: Path) -> None:
    """Workers started on an interface (`interface` option) get NCCL_SOCKET_IFNAME for it,
    before the worker starts: NCCL reads nothing else, and a running worker's environment is
    never changed."""
    from infra.cluster_specs import job_script

    options = json.loads((INFRA / "jobqueue" / "slurm-gpu.json").read_text())
    options |= {
        "interface": "lo",
        "shared_temp_directory": str(tmp_path),
        "scheduler_options": {"host": "127.0.0.1"},
    }
    script = job_script(options)
    assert "export NCCL_SOCKET_IFNAME==lo" in script
    worker = script.splitlines()[-1].split()
    assert worker[worker.index("--interface") + 1] == "lo"
    without = {k: v for k, v in options.items() if k != "interface"}
    assert "NCCL_SOCKET_IFNAME" not in job_script(without)


def test_a_job_scripts_workers_fork_from_a_preloaded_server(tmp_path: Path) -> None:
    """The job's `dask worker` carries ddpflow's worker flags (its nanny forks the worker from
    a server that imported torch and MLflow once); extra arguments of the options stay."""
    from ddpflow.cluster.workers import WORKER_CLI_ARGS
    from infra.cluster_specs import job_script

    options = json.loads((INFRA / "jobqueue" / "slurm-gpu.json").read_text())
    options |= {
        "shared_temp_directory": str(tmp_path),
        "scheduler_options": {"host": "127.0.0.1"},
        "worker_extra_args": ["--lifetime", "2h"],
    }
    worker = job_script(options).splitlines()[-1]
    assert " ".join(WORKER_CLI_ARGS) in worker and "--lifetime 2h" in worker, worker


def test_a_job_script_names_the_runs_credentials_but_holds_none(tmp_path: Path) -> None:
    """The default jobqueue cluster is tls://: its job script names the run's certificate,
    key and CA, which lie in a 0700 folder of 0600 files, and holds no key material (the
    script is written to a temporary file before submission, and Slurm keeps a copy); the
    flow's own client gets in with them; the folder goes when the cluster closes."""
    import distributed

    from ddpflow.cluster.build import build_cluster

    options = {"cores": 1, "memory": "1GB", "shared_temp_directory": str(tmp_path)}
    cluster = build_cluster("jobqueue", options | {"scheduler_options": {"host": "127.0.0.1"}})
    try:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        script = cluster.job_script()
        assert "PRIVATE KEY" not in script and "BEGIN" not in script
        worker = script.splitlines()[-1].split()
        flags = ("--tls-ca-file", "--tls-cert", "--tls-key")
        files = {flag: Path(worker[worker.index(flag) + 1]) for flag in flags}
        (folder,) = {path.parent for path in files.values()}
        assert folder.parent == tmp_path and stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert {stat.S_IMODE(path.stat().st_mode) for path in files.values()} == {0o600}
        assert "PRIVATE KEY" in files["--tls-key"].read_text()
        with distributed.Client(cluster, timeout=10) as client:
            assert client.scheduler_info()["address"] == cluster.scheduler_address
    finally:
        cluster.close()
    assert not folder.exists(), "the credentials outlived their cluster"


def test_with_tls_off_a_job_script_is_plain_tcp_and_nothing_is_written(tmp_path: Path) -> None:
    from ddpflow.cluster.build import build_cluster

    options = {"cores": 1, "memory": "1GB", "shared_temp_directory": str(tmp_path)}
    options |= {"scheduler_options": {"host": "127.0.0.1"}}
    cluster = build_cluster("jobqueue", options, tls=False)
    try:
        worker = cluster.job_script().splitlines()[-1]
        assert " tcp://127.0.0.1:" in worker and "--tls-" not in worker, worker
        assert not list(tmp_path.iterdir())
    finally:
        cluster.close()
