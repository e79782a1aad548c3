"""Each cluster kind built from its setting, for real where this machine allows it.

local: a real LocalCluster. address: a real scheduler to connect to. cuda: dask-cuda's real
LocalCUDACluster, started without GPUs through dask-cuda's own test switch (see that test).
jobqueue: real SLURMCluster / PBSCluster objects (a scheduler in this process) whose job
scripts are asserted; no job is submitted (no queue here). kubernetes needs a Kubernetes
API: tests/unit/test_cluster_specs.py validates its spec.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import distributed
import pytest

from ddpflow.cluster.build import build_cluster, local_cluster
from ddpflow.config import Settings
from ddpflow.distributed import RankContext, launch
from ddpflow.integrations.prefect import task_runner as runner
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
    with local_cluster(1, tls=False) as cluster:  # an existing tcp:// scheduler
        env = {"DDPFLOW_DASK_ADDRESS": cluster.scheduler_address}
        task_runner = runner.dask_task_runner(Settings.from_env(env, project_dir=tmp_path))
        with task_runner:
            client = task_runner.client
            assert client.scheduler.address == cluster.scheduler_address
            client.wait_for_workers(1, timeout=30)
            assert len(client.scheduler_info()["workers"]) == 1


def _rank_devices(ctx: RankContext) -> tuple[int, str, str]:
    return ctx.rank, ctx.backend, os.environ["CUDA_VISIBLE_DEVICES"]


def test_cuda_kind_builds_a_local_cuda_cluster_with_rotated_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real dask_cuda.LocalCUDACluster, through the settings, as a flow builds it.

    No GPU here, so two things stand in for one: torch.cuda.is_available() says True in
    this process (ddpflow refuses the cuda kind otherwise), and DASK_CUDA_TEST_DISABLE_
    DEVICE_SPECIFIC=1 (dask-cuda's own switch for its GPU-less tests) skips the NVML calls
    for CPU affinity and device-memory spilling; `device_memory_limit: null` likewise. The
    workers log "Unable to start CUDA Context" and carry on. Everything else is real: the
    worker processes, their rotated CUDA_VISIBLE_DEVICES, the GPU resource, the environment
    handed over, and a 2-rank launch that asks for GPU=1 (gloo, as no rank has CUDA).
    """
    monkeypatch.setenv("DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC", "1")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(
        "ddpflow.integrations.prefect.task_runner.prefect_api_url", lambda: "http://127.0.0.1:9/api"
    )
    options = {"CUDA_VISIBLE_DEVICES": "0,1", "device_memory_limit": None, "n_workers": 2}
    env = {"DDPFLOW_CLUSTER": "cuda", "DDPFLOW_CLUSTER_OPTIONS": json.dumps(options)}
    task_runner = runner.dask_task_runner(Settings.from_env(env, project_dir=tmp_path))
    with (
        task_runner.cluster_class(**task_runner.cluster_kwargs) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        assert type(cluster).__name__ == "LocalCUDACluster"
        workers = client.scheduler_info()["workers"].values()
        assert [(w["nthreads"], w["resources"]) for w in workers] == [(1, {"GPU": 1})] * 2
        seen = client.run(
            lambda: (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["PREFECT_API_URL"])
        )
        # Each worker's own GPU comes first, so it is that worker's cuda:0.
        assert sorted(seen.values()) == [
            ("0,1", "http://127.0.0.1:9/api"),
            ("1,0", "http://127.0.0.1:9/api"),
        ]
        ranks = launch(client, _rank_devices, world_size=2, timeout_s=30, resources={"GPU": 1})
        assert [r[:2] for r in ranks] == [(0, "gloo"), (1, "gloo")]
        assert sorted(r[2].split(",")[0] for r in ranks) == ["0", "1"], "one GPU per rank"


def test_dask_cuda_worker_joins_a_scheduler_with_one_gpu_worker_per_device() -> None:
    """The documented way to add a multi-GPU host to a long-lived scheduler (the stack's, the
    `address` kind): `dask cuda worker ADDRESS --resources GPU=1`, a real process here. No
    GPU, so dask-cuda's DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC switch and
    `--device-memory-limit 0` keep it from NVML, as in the test above."""
    dask = Path(sys.executable).with_name("dask")
    env = {**os.environ, "DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC": "1"}
    env["CUDA_VISIBLE_DEVICES"] = "0,1"  # the host's two GPUs
    # The workers import the rank function's module from pytest's sys.path, as spawned
    # LocalCluster workers do.
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    with (
        local_cluster(0, tls=False) as cluster,  # the `dask cuda worker` joins by address
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        command = [str(dask), "cuda", "worker", cluster.scheduler_address]
        command += ["--resources", "GPU=1", "--nthreads", "1", "--host", "127.0.0.1"]
        command += ["--device-memory-limit", "0", "--no-dashboard"]
        worker = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(2, timeout=60)
            devices = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
            assert sorted(devices.values()) == ["0,1", "1,0"]
            ranks = launch(client, _rank_devices, world_size=2, timeout_s=30, resources={"GPU": 1})
            assert sorted(r[2].split(",")[0] for r in ranks) == ["0", "1"]
        finally:
            worker.terminate()
            worker.wait(30)


def _options(name: str, tmp_path: Path) -> dict:
    # The examples' throwaway TLS certificates go to tmp_path here, not to $HOME.
    options = json.loads((INFRA / "jobqueue" / name).read_text())
    return {**options, "shared_temp_directory": str(tmp_path)}


def test_slurm_job_script_from_the_shipped_example(tmp_path: Path) -> None:
    script = job_script(_options("slurm-gpu.json", tmp_path))
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
        "export DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL=1s",
        "export DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL=1s",
        "export DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL=2s",
        "export DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON="
        + shlex.quote("{'MALLOC_TRIM_THRESHOLD_': None}"),
        "source $HOME/ddpflow/.venv/bin/activate",
        # The checkout: the wheel ships only ddpflow; the worker unpickles the flows' tasks.
        "export PYTHONPATH=$HOME/ddpflow",
    ]
    worker = lines[-1]
    assert worker.startswith("python -m distributed.cli.dask_worker tls://")
    assert "--nthreads 8" in worker and "--resources GPU=1" in worker
    assert "--local-directory ${TMPDIR:-/tmp}" in worker


def test_pbs_job_script_from_the_shipped_example(tmp_path: Path) -> None:
    lines = job_script(_options("pbs-gpu.json", tmp_path)).splitlines()
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
