"""2-rank NCCL DDP on GPUs: a collective across two GPUs, then the image flow end to end.

Needs two CUDA GPUs; skipped cleanly otherwise (CI and the CPU development machines have
none). Each GPU gets its own Dask worker that declares GPU=1 and sees only that GPU
(CUDA_VISIBLE_DEVICES rotated, as dask-cuda and compose's device reservations do), so
every rank's cuda:0 is a different physical GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddpflow.distributed import RankContext

REPO = Path(__file__).resolve().parents[2]
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(NUM_GPUS < 2, reason=f"needs 2 CUDA GPUs, found {NUM_GPUS}"),
]


# `python -m flows.train_images --world-size 2 --epochs 2`, with the launcher's INFO line
# ("launching 2 ranks (nccl) on ...") shown.
RUN_IMAGES_WITH_LAUNCHER_LOG = """
import logging, runpy, sys
logging.getLogger("ddpflow.distributed.launcher").setLevel(logging.INFO)
sys.argv = ["train_images", "--world-size", "2", "--epochs", "2"]
runpy.run_module("flows.train_images", run_name="__main__")
"""


def _rotated(index: int) -> str:
    order = list(range(NUM_GPUS))
    return ",".join(str(d) for d in order[index:] + order[:index])


@pytest.fixture(scope="module")
def gpu_workers() -> Iterator[tuple]:
    from tests.helpers.resource_cluster import resource_cluster

    workers = {
        f"gpu-{i}": {"resources": {"GPU": 1}, "env": {"CUDA_VISIBLE_DEVICES": _rotated(i)}}
        for i in range(2)
    }
    with resource_cluster(workers) as started:
        yield started


def _nccl_rank(ctx: RankContext) -> tuple[str, str, str, float]:
    import torch.distributed as dist

    value = torch.ones(1, device=ctx.device) * (ctx.rank + 1)
    dist.all_reduce(value)
    bus_id = torch.cuda.get_device_properties(0).pci_bus_id
    return ctx.backend, str(ctx.device), bus_id, float(value.item())


def test_two_ranks_all_reduce_over_nccl_on_two_gpus(gpu_workers) -> None:
    from ddpflow.distributed import launch

    _, client, _ = gpu_workers
    results = launch(client, _nccl_rank, world_size=2, timeout_s=120, resources={"GPU": 1})
    assert [r[0] for r in results] == ["nccl", "nccl"]
    assert [r[1] for r in results] == ["cuda:0", "cuda:0"]
    assert len({r[2] for r in results}) == 2, "each rank on its own physical GPU"
    assert [r[3] for r in results] == [3.0, 3.0]


@pytest.mark.skipif(
    importlib.util.find_spec("flows.train_images") is None,
    reason="flows.train_images (the image workload) is not in this checkout",
)
def test_image_flow_trains_with_two_nccl_ranks(gpu_workers, tmp_path: Path) -> None:
    cluster, _, _ = gpu_workers
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        {
            "DDPFLOW_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "PREFECT_HOME": str(tmp_path / ".prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_EXTRA_LOGGERS": "ddpflow",  # the launcher's line, with the backend
            "DDPFLOW_DASK_ADDRESS": cluster.scheduler_address,
            "DDPFLOW_RANK_RESOURCES": '{"GPU": 1}',
            "PYTHONPATH": str(REPO),
        }
    )
    argv = [sys.executable, "-c", RUN_IMAGES_WITH_LAUNCHER_LOG]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "world size         2 ranks" in output
    assert "launching 2 ranks (nccl)" in output


def test_the_cuda_kind_runs_nccl_ranks_one_per_gpu() -> None:
    """DDPFLOW_CLUSTER=cuda: dask-cuda's LocalCUDACluster, one worker per GPU, each rank on
    its worker's cuda:0 (a different physical GPU per rank)."""
    import distributed

    from ddpflow.cluster.build import build_cluster
    from ddpflow.distributed import launch

    with (
        build_cluster("cuda", {"CUDA_VISIBLE_DEVICES": "0,1"}) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        results = launch(client, _nccl_rank, world_size=2, timeout_s=120, resources={"GPU": 1})
    assert [r[:2] for r in results] == [("nccl", "cuda:0"), ("nccl", "cuda:0")]
    assert len({r[2] for r in results}) == 2, "each rank on its own physical GPU"
    assert [r[3] for r in results] == [3.0, 3.0]
