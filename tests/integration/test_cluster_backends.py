"""Each cluster kind built from its setting, for real where this machine allows it.

local: a real LocalCluster. address: a real scheduler to connect to. jobqueue: real
SLURMCluster / PBSCluster objects (a scheduler in this process) whose job scripts are
asserted; no job is submitted (no queue here). cuda and kubernetes need GPUs / a
Kubernetes API: tests/unit/test_cluster_config.py and test_cluster_specs.py cover them.
"""

from __future__ import annotations

import json
from pathlib import Path

import distributed
import pytest

from ddpflow.cluster import build_cluster, local_cluster
from ddpflow.config import Settings
from flows import runner
from infra.cluster_specs import job_script

pytestmark = pytest.mark.integration
INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_local_kind_builds_workers_times_threads(tmp_path: Path) -> None:
    env = {"DDPFLOW_DASK_WORKERS": "1", "DDPFLOW_CLUSTER_OPTIONS": '{"threads_per_worker": 2}'}
    task_runner = runner.dask_task_runner(Settings.from_env(env, project_dir=tmp_path))
    with (
        task_runner.cluster_class(**task_runner.cluster_kwargs) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        workers = client.scheduler_info()["workers"].values()
        assert [w["nthreads"] for w in workers] == [2]


def test_address_kind_connects_to_a_running_scheduler(tmp_path: Path) -> None:
    with local_cluster(1) as cluster:
        env = {"DDPFLOW_DASK_ADDRESS": cluster.scheduler_address}
        task_runner = runner.dask_task_runner(Settings.from_env(env, project_dir=tmp_path))
        with task_runner:
            client = task_runner.client
            assert client.scheduler.address == cluster.scheduler_address
            client.wait_for_workers(1, timeout=30)
            assert len(client.scheduler_info()["workers"]) == 1


def _options(name: str) -> dict:
    return json.loads((INFRA / "jobqueue" / name).read_text())


def test_slurm_job_script_from_the_shipped_example() -> None:
    script = job_script(_options("slurm-gpu.json"))
    lines = script.splitlines()
    for directive in (
        "#SBATCH -p gpu",
        "#SBATCH -A my-project",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH -t 02:00:00",
        "#SBATCH --gres=gpu:1",
    ):
        assert directive in lines, directive
    # ddpflow's worker settings come first, then the example's own prologue.
    prologue = [line for line in lines if line.startswith(("export", "module", "source"))]
    assert prologue == [
        "export DASK_DISTRIBUTED__WORKER__DAEMON=False",
        "export DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False",
        "module load cuda",
        "source $HOME/ddpflow/.venv/bin/activate",
    ]
    worker = lines[-1]
    assert worker.startswith("python -m distributed.cli.dask_worker tcp://")
    assert "--nthreads 8" in worker and "--resources GPU=1" in worker
    assert "--local-directory $TMPDIR" in worker


def test_pbs_job_script_from_the_shipped_example() -> None:
    lines = job_script(_options("pbs-gpu.json")).splitlines()
    for directive in (
        "#PBS -q gpu",
        "#PBS -l select=1:ncpus=8:ngpus=1:mem=64GB",
        "#PBS -l walltime=02:00:00",
        "#PBS -V",
    ):
        assert directive in lines, directive
    assert "--resources GPU=1" in lines[-1]


def test_jobqueue_kind_builds_without_submitting_a_job(tmp_path: Path) -> None:
    """Through the settings, as a flow would (n_workers=0: nothing is queued)."""
    options = {"system": "pbs", "cores": 2, "memory": "4GB", "walltime": "00:10:00"}
    env = {"DDPFLOW_CLUSTER": "jobqueue", "DDPFLOW_CLUSTER_OPTIONS": json.dumps(options)}
    settings = Settings.from_env(env, project_dir=tmp_path)
    cluster = build_cluster(settings.cluster_kind, settings.cluster_options)
    try:
        assert type(cluster).__name__ == "PBSCluster"
        assert cluster.workers == {} and cluster.worker_spec == {}
        assert "--nthreads 2" in cluster.job_script(), "processes=1: one rank per job"
    finally:
        cluster.close()
