"""GPU-resource routing on a real local cluster whose workers declare resources.

Three worker processes, as a GPU cluster would have them: `cpu-0` declares CPU=1 (what
compose's CPU worker does), `gpu-0` and `gpu-1` declare GPU=1 (`dask worker --resources
GPU=1`). This machine has no GPU, so the ranks still use gloo: what is tested is where
Dask puts each task. The mixed-device rejection needs workers that *report* CUDA; the
launcher's CUDA probe is replaced by one that says "GPU" for the GPU-declared workers,
which is the only thing faked here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import dask
import distributed
import pytest
import torch
import torch.distributed as dist

from ddpflow.cluster.build import task_placement
from ddpflow.distributed import PlanError, RankContext, launch
from tests.helpers.resource_cluster import resource_cluster

pytestmark = pytest.mark.integration
WORKERS = {
    "cpu-0": {"resources": {"CPU": 1}},
    "gpu-0": {"resources": {"GPU": 1}},
    "gpu-1": {"resources": {"GPU": 1}},
}


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[tuple[distributed.SpecCluster, distributed.Client, dict]]:
    with resource_cluster(WORKERS) as started:
        yield started


def _rank_where(ctx: RankContext) -> tuple[int, str, str, float]:
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    return ctx.rank, ctx.backend, distributed.get_worker().address, float(value)


def _task_where(seconds: float) -> str:
    time.sleep(seconds)
    return distributed.get_worker().address


def test_ranks_land_only_on_gpu_declared_workers(gpu_cluster) -> None:
    _, client, addresses = gpu_cluster
    results = launch(client, _rank_where, world_size=2, timeout_s=30, resources={"GPU": 1})
    assert [r[0] for r in results] == [0, 1]
    assert {r[2] for r in results} == {addresses["gpu-0"], addresses["gpu-1"]}
    assert all(r[3] == 2.0 for r in results), "the two ranks formed one group"


def test_world_size_none_takes_every_gpu_worker_and_no_other(gpu_cluster) -> None:
    _, client, addresses = gpu_cluster
    results = launch(client, _rank_where, timeout_s=30, resources={"GPU": 1})
    assert sorted(r[2] for r in results) == sorted([addresses["gpu-0"], addresses["gpu-1"]])


def test_too_few_gpu_workers_fails_before_any_rank_starts(gpu_cluster) -> None:
    _, client, _ = gpu_cluster
    with pytest.raises(
        PlanError, match=r"with resources \{'GPU': 1\}, but 2 of the 3 workers declare them"
    ):
        launch(client, _rank_where, world_size=3, timeout_s=30, resources={"GPU": 1})


def _rank_until(ctx: RankContext, release: str) -> int:
    """Runs until the test has looked at the scheduler's tasks (beating meanwhile)."""
    done = distributed.Event(release, client=distributed.get_client())
    while not done.wait(0.2):
        ctx.heartbeat()
    return ctx.rank


def test_the_rank_tasks_ask_the_scheduler_for_the_gpu(gpu_cluster) -> None:
    """The resources reach Client.submit: the scheduler holds them on each rank's task."""
    cluster, client, _ = gpu_cluster
    release = f"routing-seen-{uuid.uuid4().hex}"
    seen: list[dict] = []
    with ThreadPoolExecutor(1) as pool:
        group = pool.submit(
            launch, client, _rank_until, release, world_size=2, timeout_s=30, resources={"GPU": 1}
        )
        try:
            # The ranks run until released, so their tasks stay on the scheduler to be seen.
            deadline = time.monotonic() + 120
            while len(seen) < 2 and time.monotonic() < deadline and not group.done():
                ranks = [
                    ts for key, ts in cluster.scheduler.tasks.items() if "ddp-rank" in str(key)
                ]
                seen = [dict(ts.resource_restrictions or {}) for ts in ranks]
                time.sleep(0.05)
        finally:
            distributed.Event(release, client=client).set()
        assert group.result(timeout=60) == [0, 1]
    assert len(seen) == 2 and all(r == {"GPU": 1} for r in seen), seen


def _cuda_on_gpu_workers(dask_worker: distributed.Worker) -> bool:
    """Stands in for torch.cuda.is_available() on a machine without GPUs."""
    return dask_worker.state.total_resources.get("GPU", 0) > 0


def test_a_mixed_cpu_gpu_group_is_rejected(gpu_cluster, monkeypatch) -> None:
    _, client, _ = gpu_cluster
    monkeypatch.setattr("ddpflow.distributed.launcher.cuda_available", _cuda_on_gpu_workers)
    with pytest.raises(PlanError, match="mixed rank group.*NCCL needs a GPU on every rank"):
        launch(client, _rank_where, world_size=3, timeout_s=30)


def test_other_tasks_stay_on_the_cpu_worker(gpu_cluster) -> None:
    _, client, addresses = gpu_cluster
    placement = task_placement(client.scheduler_info()["workers"])
    assert placement == {"resources": {"CPU": 1}}
    with dask.annotate(**placement):
        placed = [client.submit(_task_where, 0.2, pure=False) for _ in range(6)]
    assert set(client.gather(placed)) == {addresses["cpu-0"]}
    # Without the placement the same tasks spread to the idle GPU workers.
    spread = [client.submit(_task_where, 0.2, pure=False) for _ in range(6)]
    assert len(set(client.gather(spread))) > 1


def test_prefect_tasks_stay_on_the_cpu_worker(prefect_api_url, monkeypatch) -> None:
    """The flows' task runner applies the placement itself: a real flow on a real cluster,
    with .submit and .map, as download/format/evaluate are submitted."""
    from prefect import flow, task
    from prefect.settings import PREFECT_API_URL

    from ddpflow.integrations.prefect.task_runner import PlacingDaskTaskRunner

    @task
    def where(seconds: float) -> str:
        return _task_where(seconds)

    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env = {"PREFECT_API_URL": PREFECT_API_URL.value()}  # workers report to the same API
    workers = {name: {**spec, "env": env} for name, spec in WORKERS.items()}
    with resource_cluster(workers) as (cluster, _, addresses):

        @flow(task_runner=PlacingDaskTaskRunner(address=cluster.scheduler_address))
        def placed() -> list[str]:
            submitted = [where.submit(0.2) for _ in range(4)]
            mapped = where.map([0.2] * 4)
            return [f.result() for f in submitted] + [f.result() for f in mapped]

        assert set(placed()) == {addresses["cpu-0"]}
