"""The DDP launcher on a real LocalCluster (2 worker processes, gloo)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import distributed
import pytest
import torch
import torch.distributed as dist

from ddpflow.api import rank_entry
from ddpflow.distributed import LaunchError, RankContext, launch
from ddpflow.distributed.progress import Progress, line_subscriber
from ddpflow.distributed.supervisor.relaunch import RepeatedFailure, launch_with_restarts
from ddpflow.distributed.supervisor.timings import SupervisionConfig
from ddpflow.integrations.prefect.progress_artifact import ProgressArtifact
from ddpflow.tracking.run import default_artifact_location, metric_history, start_run
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.data import fetch_corpus, format_corpus
from ddpflow.workloads.charlm.job import CharLMTrainJob
from ddpflow.workloads.charlm.training import train_rank
from tests.helpers.rank_functions import join_slowly_once, started_at, stuck_once

pytestmark = pytest.mark.integration


def _all_reduce_rank(ctx: RankContext) -> tuple[int, int, float, int]:
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, float(value), torch.get_num_threads()


def _fail_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    return ctx.rank


def _block_until(running: str, release: str) -> None:
    client = distributed.get_client()
    distributed.Event(running, client=client).set()
    distributed.Event(release, client=client).wait(120)


def _wait_idle(client: distributed.Client) -> None:
    """Both workers there, idle, and with torch imported: a worker replaced by the test
    before takes seconds to start on a loaded machine, and the next test's short timeouts
    would count that against its ranks."""
    deadline = time.monotonic() + 60
    client.wait_for_workers(2, timeout=60)
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    client.run(_import_torch)


def _import_torch() -> str:
    return torch.__version__


@pytest.fixture(autouse=True)
def _idle_workers_first(dask_client: distributed.Client) -> None:
    """Every test starts on two idle workers, even after one that failed half-way (it may
    have lost a worker): a failure stays in its own test instead of failing the next ones
    for want of a worker."""
    _wait_idle(dask_client)


def _parent_command_line() -> str:
    return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()


# docs/charlm.md: a LocalCluster's workers fork from a server process that imported torch
# and MLflow once, so a worker start (and a restart after a lost worker) does not import
# them again; nor what a worker imports when it first trains (torch._dynamo, which every
# optimizer imports, and MLflow's SQL store).
def test_workers_fork_from_a_server_that_preloaded_torch_and_mlflow(dask_client):
    parents = dask_client.run(_parent_command_line)
    assert len(parents) == 2
    for command in parents.values():
        assert "multiprocessing.forkserver" in command, command
        assert "'torch'" in command and "'mlflow'" in command, command
    for loaded in dask_client.run(_preloaded, FIRST_TRAINING_IMPORTS).values():
        assert loaded == list(FIRST_TRAINING_IMPORTS), loaded


FIRST_TRAINING_IMPORTS = ("torch._dynamo", "mlflow.store.tracking.sqlalchemy_store")


def _preloaded(names: tuple[str, ...]) -> list[str]:
    """Which of `names` this worker process had before it ran anything (its forkserver's
    preload): this test runs first in its module, before any task of the module."""
    return [name for name in names if name in sys.modules]


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
    subscribers = [line_subscriber(lines.append)]
    launch(dask_client, _report_three_times, world_size=2, timeout_s=30, subscribers=subscribers)
    assert [line for line in lines if line.startswith("progress")] == [
        "progress 0",
        "progress 1",
        "progress 2",
    ]
    # Each rank says which worker and process host it (docs/api.md "ddpflow.run").
    pids = dask_client.run(os.getpid)
    hosts = [line.split(": ", 1) for line in lines if line.startswith("rank ")]
    assert sorted(rank for rank, _ in hosts) == ["rank 0 of 2", "rank 1 of 2"], lines
    assert {where for _, where in hosts} == {f"worker {a}, pid {p}" for a, p in pids.items()}


def _report_and_step(ctx: RankContext) -> int:
    """Rank 0 sends what fit() sends: a line, step counts alone, and both in one event."""
    if ctx.is_main:
        ctx.report("resuming")
        for step in (1, 2, 3):
            line = f"epoch 1/1 done at step {step}" if step == 3 else None
            ctx.send(Progress(line, step, 3, 1, 1, train_loss=1.0 / step))
    dist.barrier()
    return ctx.rank


# docs/api.md "ddpflow.run" (on_progress, on_event): one event stream, on one Dask topic,
# followed once by the launcher, feeds both the log lines and the progress artifact.
def test_log_lines_and_the_progress_artifact_see_the_same_events_from_one_topic(dask_client):
    topics_before = set(dask_client.get_events())
    lines: list[str] = []
    events: list[Progress] = []
    # The artifact's own subscriber; not started: no Prefect server here, and what it keeps
    # (`latest`) is what its updater thread would push.
    artifact = ProgressArtifact("progress-key", "test")
    subscribers = [line_subscriber(lines.append), artifact.update, events.append]
    launch(dask_client, _report_and_step, world_size=2, timeout_s=30, subscribers=subscribers)
    # The lines are exactly those of the events the other subscribers saw, in order: rank
    # 0's in the order sent, each rank's start line among them (the ranks run side by side).
    assert lines == [event.line for event in events if event.line is not None]
    starts = [line for line in lines if line.startswith("rank ")]
    assert [line for line in lines if line not in starts] == [
        "resuming",
        "epoch 1/1 done at step 3",
    ], lines
    assert sorted(line.split(":")[0] for line in starts) == ["rank 0 of 2", "rank 1 of 2"]
    assert [event.step for event in events if event.has_steps] == [1, 2, 3]
    # The artifact keeps the newest step counts; rank 1's start line may arrive after rank
    # 0's last step (the ranks run side by side), and a line without steps leaves it put.
    assert artifact.latest == [event for event in events if event.has_steps][-1]
    assert artifact.latest.describe() == "epoch 1/1, step 3/3 (100 %), train loss 0.3333"
    # Everything went on one topic, this launch's: no other topic carries a progress event.
    carrying = {
        topic
        for topic, sent in dask_client.get_events().items()
        if topic not in topics_before
        and any(isinstance(m, dict) and {"line", "step"} & m.keys() for _, m in sent)
    }
    assert len(carrying) == 1, carrying
    (topic,) = carrying
    assert topic.startswith("ddpflow-progress-")
    assert len(dask_client.get_events(topic)) == len(events)


def _drops_a_rank_failure_record() -> bool:
    """On a worker: a rank task's "Compute Failed" record is dropped, another task's kept."""
    worker_log = logging.getLogger("distributed.worker")
    record = worker_log.makeRecord(
        worker_log.name, logging.ERROR, __file__, 0, "Compute Failed\nKey: %s", ("?",), None
    )

    def kept(key: str) -> bool:
        record.args = (key,)
        return worker_log.filter(record)

    return not kept("ddp-rank1-0a1b") and kept("register-model-1")


def test_a_failing_rank_is_named_with_its_worker_and_cause(dask_client):
    workers = sorted(dask_client.scheduler_info()["workers"])
    with pytest.raises(LaunchError, match="boom on purpose") as info:
        launch(dask_client, _fail_on_rank_1, world_size=2, timeout_s=30)
    message = str(info.value)
    assert "rank 1" in message and workers[1] in message and "boom on purpose" in message
    # The launcher names the failure; the ranks' workers drop Dask's "Compute Failed" copy.
    assert all(dask_client.run(_drops_a_rank_failure_record).values())
    _wait_idle(dask_client)


def test_a_rank_that_cannot_start_fails_within_the_timeout(dask_client):
    """Worker 2's only thread is busy, so rank 1 (pinned there) can never start."""
    workers = sorted(dask_client.scheduler_info()["workers"])
    running, release = (f"blocker-{name}-{uuid.uuid4().hex}" for name in ("on", "off"))
    blocker = dask_client.submit(_block_until, running, release, workers=[workers[1]], pure=False)
    try:
        assert distributed.Event(running, client=dask_client).wait(60), "the blocker never ran"
        started = time.monotonic()
        with pytest.raises(LaunchError, match="did not start within 5s") as info:
            launch(dask_client, _all_reduce_rank, world_size=2, timeout_s=5)
        elapsed = time.monotonic() - started
    finally:
        distributed.Event(release, client=dask_client).set()
        blocker.result(timeout=30)
    message = str(info.value)
    assert "rank 1" in message and workers[1] in message
    assert [f.rank for f in info.value.failures] == [1]
    # Without the start timeout the launch would wait for the blocker's 120 s.
    assert elapsed < 60, f"took {elapsed:.1f}s"
    _wait_idle(dask_client)


def _peer_error_after(seconds: float) -> None:
    time.sleep(seconds)
    raise RuntimeError("Connection closed by peer (as gloo says when its peer dies)")


def _exit_now() -> None:
    os._exit(1)


def test_a_worker_lost_while_the_group_starts_is_named_not_only_its_peers_error(dask_client):
    """A group fast enough to fail before the launcher has seen every rank start (a loaded
    machine, a tiny model) is still described by the worker that died: the peer's
    "connection closed" names no one. The launcher's start wait is called directly with
    ranks that never signal their start, so the race is fixed, not left to timing."""
    from ddpflow.distributed.planning import RankAssignment
    from ddpflow.distributed.supervisor.watch import wait_for_start
    from ddpflow.distributed.supervisor.wording import words

    workers = sorted(dask_client.scheduler_info()["workers"])
    plan = [RankAssignment(rank, address, "127.0.0.1", 1) for rank, address in enumerate(workers)]
    futures = [
        dask_client.submit(_peer_error_after, 1.0, workers=[workers[0]], pure=False),
        dask_client.submit(_exit_now, workers=[workers[1]], pure=False),
    ]
    try:
        with pytest.raises(LaunchError) as info:
            wait_for_start(dask_client, plan, futures, f"never-{uuid.uuid4().hex}", 60)
    finally:
        dask_client.cancel(futures, force=True)
    message = str(info.value)
    assert f"rank 1 on worker {workers[1]}: {words('worker_left')}" in message, message
    assert "Connection closed by peer" in message, message
    _wait_idle(dask_client)


def test_one_rank_uses_the_same_code_path_and_loss_falls(dask_client, tmp_path):
    from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH

    root = str(tmp_path / "artifacts")
    corpus = format_corpus(fetch_corpus(str(DEFAULT_CORPUS_PATH), root).uri, root, 0.1)
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The checkpoints beside the store: MLflow's default is ./mlruns of the worker's working
    # directory, the checkout.
    location = default_artifact_location(tracking_uri, tmp_path)
    run = start_run(tracking_uri, "launcher-test", "one-rank", {}, {}, location)
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
    ((result, unsent),) = launch(
        dask_client,
        rank_entry,
        train_rank,
        (job,),
        job.train_settings(),
        run,
        world_size=1,
        timeout_s=60,
    )
    assert unsent == ()
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
    """Two launches (as from two flow runs) each want both workers: the second waits.

    This passes without the reservation whenever Dask queues the ranks in order; the
    reservation itself is proven in test_reservation.py."""
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
    # Grace (3 s) + a replacement worker importing torch: seconds, though many on a loaded
    # machine; waiting for the stuck rank would take its 120 s.
    assert max(results) - failed_at < 60, f"relaunch ran {max(results) - failed_at:.1f}s later"
    _wait_idle(dask_client)


def test_no_rank_starts_its_function_before_every_rank_has_joined(dask_client, tmp_path):
    """A rank whose function ends at once must not leave the group while a slower peer is
    still joining it: gloo's join returned on one side first, and the peer's join then
    failed with "Connection closed by peer" (a full run on 1edceba: a relaunch onto a
    replacement worker). One worker's join is made 2 s slower; both ranks' functions begin
    only after it joined."""
    joined = tmp_path / "joined"
    slow = sorted(dask_client.scheduler_info()["workers"])[0]
    dask_client.run(join_slowly_once, str(joined), 2.0, workers=[slow])
    starts = launch(dask_client, started_at, world_size=2, timeout_s=30)
    assert min(starts) >= float(joined.read_text()), "a rank began before its peer joined"


@pytest.mark.timeout(120)
def test_a_worker_that_does_not_answer_fails_the_launch_naming_it(dask_client):
    """A stopped worker (SIGSTOP: hung, as far as anyone can tell) never answers the
    launcher's questions. The bound is shortened from 60 s to keep the test quick."""
    quick = SupervisionConfig(start_ask_timeout_s=3.0)
    pids = dask_client.run(os.getpid)
    hung = sorted(pids)[1]
    os.kill(pids[hung], signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(
            LaunchError, match=r"did not answer cuda_available\(\) within 3s"
        ) as info:
            launch(dask_client, _all_reduce_rank, world_size=2, timeout_s=30, supervision=quick)
        elapsed = time.monotonic() - started
    finally:
        os.kill(pids[hung], signal.SIGCONT)
    assert [f.worker_address for f in info.value.failures] == [hung]
    # An unbounded question would wait for the stopped worker until the test's timeout.
    assert elapsed < 60, f"took {elapsed:.1f}s"
    _wait_idle(dask_client)


def _steps_then_hangs(ctx: RankContext) -> int:
    """Three training steps, then stuck (in IO, say) far longer than the timeout."""
    for _ in range(3):
        time.sleep(0.1)
        ctx.heartbeat()
    time.sleep(120)
    return ctx.rank


def test_a_lone_rank_that_stops_stepping_fails_its_group(dask_client):
    """A group of one has no peer whose collective would time out: the launcher's step
    watchdog fails it, and the stuck worker is freed for the next group."""
    _wait_idle(dask_client)  # a worker's first task imports this module: seconds
    workers = sorted(dask_client.scheduler_info()["workers"])
    started = time.monotonic()
    with pytest.raises(LaunchError, match="no training step for more than 5 s") as info:
        launch(dask_client, _steps_then_hangs, world_size=1, timeout_s=5)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "rank 0" in message and "no training step for more than 5 s" in message
    assert info.value.failures[0].worker_address in workers
    assert info.value.training_started
    assert elapsed < 60, f"took {elapsed:.1f}s, the stuck rank would take 120 s"
    _wait_idle(dask_client)


def _slow_but_stepping(ctx: RankContext, steps: int, step_s: float) -> int:
    for _ in range(steps):
        time.sleep(step_s)
        ctx.heartbeat()
    return ctx.rank


def test_a_slow_rank_that_keeps_stepping_is_left_alone(dask_client):
    """Steps 1 s apart for 8 s, more than the 5 s timeout in all: progress, not a stall.
    Each gap leaves 4 s of slack for a loaded machine."""
    _wait_idle(dask_client)  # the test before replaced a worker
    assert launch(dask_client, _slow_but_stepping, 8, 1.0, world_size=1, timeout_s=5) == [0]


def _config_error_at_start(ctx: RankContext, marker_dir: str) -> None:
    """Every attempt fails the same way before its first step, as a model config that
    cannot be built does. Each rank that gets here marks its attempt (one file per launch):
    under load one rank's process group set-up can fail first when its peer already raised,
    so counting only rank 0's marks would miss an attempt."""
    (Path(marker_dir) / f"attempt-{ctx.launch_id}").touch()
    raise ValueError("hidden_size=0: cannot build the model")


def test_a_failure_repeating_before_the_first_step_is_not_retried(dask_client, tmp_path):
    with pytest.raises(RepeatedFailure, match="restarting will not help") as info:
        launch_with_restarts(
            dask_client,
            _config_error_at_start,
            str(tmp_path),
            world_size=2,
            timeout_s=30,
            max_restarts=3,
        )
    assert len(list(tmp_path.iterdir())) == 2, "tried twice, not max_restarts + 1 times"
    message = str(info.value)
    assert "before training started" in message and "restarting will not help" in message
    assert "ValueError: hidden_size=0: cannot build the model" in message
    _wait_idle(dask_client)


def _crashes_mid_run_twice(ctx: RankContext, marker_dir: str) -> int:
    """Steps, then the same crash in the first two attempts; the third completes."""
    for _ in range(3):
        ctx.heartbeat()
    crashes = len(list(Path(marker_dir).iterdir()))
    dist.barrier()  # both ranks counted the crashes before rank 0 adds one
    if crashes < 2:
        if ctx.rank == 0:
            (Path(marker_dir) / f"crash-{crashes}").touch()
        dist.barrier()
        raise RuntimeError("lost the connection to the data store")
    return ctx.rank


def test_a_crash_after_training_started_is_still_restarted(dask_client, tmp_path):
    results, restarts = launch_with_restarts(
        dask_client, _crashes_mid_run_twice, str(tmp_path), world_size=2, timeout_s=30
    )
    assert results == [0, 1]
    assert len(restarts) == 2, "the same mid-run crash twice is retried both times"
    assert all("lost the connection" in r.cause for r in restarts)
    _wait_idle(dask_client)
