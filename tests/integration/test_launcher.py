"""The DDP launcher on a real LocalCluster (2 worker processes, gloo)."""

from __future__ import annotations

import time

import distributed
import pytest
import torch
import torch.distributed as dist

from ddpflow.charlm.data import fetch_corpus, format_corpus
from ddpflow.charlm.model import CharLSTMConfig
from ddpflow.charlm.training import CharLMTrainJob, train_rank
from ddpflow.distributed import LaunchError, RankContext, launch
from ddpflow.distributed.elastic import launch_with_restarts
from ddpflow.tracking import metric_history, start_run
from tests.integration.rank_functions import stuck_once

pytestmark = pytest.mark.integration


def _all_reduce_rank(ctx: RankContext) -> tuple[int, int, float, int]:
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, float(value), torch.get_num_threads()


def _fail_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    return ctx.rank


def _block_until(event_name: str) -> None:
    distributed.Event(event_name, client=distributed.get_client()).wait(120)


def _wait_idle(client: distributed.Client) -> None:
    deadline = time.monotonic() + 60
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.2)


def test_two_ranks_form_one_group_one_thread_each(dask_client):
    results = launch(dask_client, _all_reduce_rank, world_size=2, timeout_s=30)
    assert [r[0] for r in results] == [0, 1]
    assert all(r[1] == 2 and r[2] == 3.0 and r[3] == 1 for r in results)


def _report_three_times(ctx: RankContext) -> int:
    for i in range(3):
        if ctx.is_main:
            ctx.report(f"progress {i}")
        dist.barrier()
    return ctx.rank


def test_rank_reports_reach_the_launching_process_in_order(dask_client):
    lines: list[str] = []
    launch(dask_client, _report_three_times, world_size=2, timeout_s=30, on_progress=lines.append)
    assert lines == ["progress 0", "progress 1", "progress 2"]


def test_a_failing_rank_is_named_with_its_worker_and_cause(dask_client):
    workers = sorted(dask_client.scheduler_info()["workers"])
    with pytest.raises(LaunchError) as info:
        launch(dask_client, _fail_on_rank_1, world_size=2, timeout_s=30)
    message = str(info.value)
    assert "rank 1" in message and workers[1] in message and "boom on purpose" in message
    _wait_idle(dask_client)


def test_a_rank_that_cannot_start_fails_within_the_timeout(dask_client):
    """Worker 2's only thread is busy, so rank 1 (pinned there) can never start."""
    workers = sorted(dask_client.scheduler_info()["workers"])
    blocker = dask_client.submit(_block_until, "release-blocker", workers=[workers[1]], pure=False)
    time.sleep(1.0)
    started = time.monotonic()
    try:
        with pytest.raises(LaunchError) as info:
            launch(dask_client, _all_reduce_rank, world_size=2, timeout_s=5)
        elapsed = time.monotonic() - started
    finally:
        distributed.Event("release-blocker", client=dask_client).set()
        blocker.result(timeout=30)
    message = str(info.value)
    assert "rank 1" in message and workers[1] in message and "did not start within 5s" in message
    assert [f.rank for f in info.value.failures] == [1]
    assert elapsed < 15, f"took {elapsed:.1f}s"
    _wait_idle(dask_client)


def test_one_rank_uses_the_same_code_path_and_loss_falls(dask_client, tmp_path):
    from ddpflow.charlm.corpus import DEFAULT_CORPUS_PATH

    root = str(tmp_path / "artifacts")
    corpus = format_corpus(fetch_corpus(str(DEFAULT_CORPUS_PATH), root).uri, root, 0.1)
    run = start_run(f"sqlite:///{tmp_path / 'mlflow.db'}", "launcher-test", "one-rank", {}, {})
    job = CharLMTrainJob(
        train_uri=corpus.train_uri,
        val_uri=corpus.val_uri,
        model=CharLSTMConfig(hidden_size=32, num_layers=1),
        epochs=2,
        batch_size=2048,
        lr=0.01,
        seed=0,
        checkpoint_root=f"{root}/ckpt",
        keep_last=2,
        run=run,
    )
    (result,) = launch(dask_client, train_rank, job, world_size=1, timeout_s=60)
    assert [s.epoch for s in result.history] == [1, 2]
    assert result.history[1].val_loss < result.history[0].val_loss
    assert [step for step, _ in metric_history(run, "val_loss")] == [1, 2]
    assert result.latest_checkpoint.endswith("epoch-0002.pt")


def _slow_group(ctx: RankContext, seconds: float) -> float:
    started = time.time()
    time.sleep(seconds)
    dist.barrier()
    return started


def test_two_groups_at_once_take_turns_instead_of_clashing(dask_client):
    """Two launches (as from two flow runs) each want both workers: the second waits."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(launch, dask_client, _slow_group, 3.0, world_size=2, timeout_s=30)
        second = pool.submit(launch, dask_client, _slow_group, 3.0, world_size=2, timeout_s=30)
        starts = sorted([min(first.result(timeout=120)), min(second.result(timeout=120))])
    assert starts[1] - starts[0] >= 2.5, "the groups ran one after the other"


def test_a_relaunch_does_not_wait_for_a_stuck_rank_of_the_failed_group(dask_client, tmp_path):
    """Cancelling rank 1's task cannot stop its thread: its worker is ended and replaced, so
    the relaunch runs within seconds instead of after rank 1's 120 s."""
    results, restarts = launch_with_restarts(
        dask_client, stuck_once, str(tmp_path), world_size=2, timeout_s=60, max_restarts=1
    )
    failed_at = float((tmp_path / "rank0").read_text())
    assert len(restarts) == 1 and "rank 0 fails on purpose" in restarts[0].cause
    assert max(results) - failed_at < 10, f"relaunch ran {max(results) - failed_at:.1f}s later"
    _wait_idle(dask_client)
