"""No decision reads a cause's words: with every template of the supervisor's wording replaced by
unrelated text, in the launching process and on every worker (a worker plugin, so a worker a
nanny restarts gets it too), the launcher still does what it does for each kind of failure.

One scenario per kind, each a shortened twin of a fault test that checks the words as well:
- raised, before any step, twice (follow-on peers): given up as deterministic after two
  attempts (test_launcher.py::test_a_failure_repeating_before_the_first_step_is_not_retried);
- worker lost (SIGKILL-like exit mid-training, follow-on peer): one restart, then done
  (test_fault_tolerance.py's kills);
- preempted (retire_workers) and peer stopped: one restart, after the group stopped at its
  next control step (test_graceful_close.py);
- grow (a worker joins and stays): relaunched at 3 ranks, no restart spent
  (test_elastic_grow.py);
- stalled (a lone rank stops stepping) and did not start (a stopped worker): the group fails,
  and with no restart allowed the launcher gives up (test_launcher.py).
The kinds and the launcher's decisions are recorded from the policy; the causes it wrote are
checked to hold only the reworded text.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
import pytest
import torch
import torch.distributed as dist
from distributed.diagnostics.plugin import WorkerPlugin

from ddpflow.cluster.build import local_cluster
from ddpflow.distributed import RankContext
from ddpflow.distributed.supervisor import relaunch, wording
from ddpflow.distributed.supervisor.failures import FailureKind, LaunchError
from ddpflow.distributed.supervisor.graceful_stop import GracefulNannyStop, GracefulStop
from ddpflow.distributed.supervisor.policy import Action, Decision
from ddpflow.distributed.supervisor.relaunch import (
    RepeatedFailure,
    Resize,
    RestartsExhausted,
    launch_with_restarts,
)
from ddpflow.distributed.supervisor.timings import SupervisionConfig
from tests.helpers.leave_ranks import CONTROL_EVERY, steps_until_asked

pytestmark = pytest.mark.integration
K = FailureKind
# Text that shares nothing with any template: no field, no word of the original.
REWORDED = {name: f"qx{i}zv" for i, name in enumerate(wording.MESSAGES)}
ORIGINAL_WORDS = ("left the cluster", "asked to stop", "grows", "did not", "no training step")


class Reworded(WorkerPlugin):
    """Rewords the templates in every worker process, those started later included."""

    name = "ddpflow-test-reworded"

    def setup(self, worker: Any) -> None:
        from ddpflow.distributed.supervisor import wording

        wording.MESSAGES.update(REWORDED)


class Decisions:
    """The policy's decisions, with the kinds of the failures each was about."""

    def __init__(self) -> None:
        self.seen: list[tuple[set[FailureKind], Decision]] = []

    def record(self, error: LaunchError, **options: Any) -> Decision:
        decision = DECIDE(error, **options)
        self.seen.append(({f.kind for f in error.failures}, decision))
        assert all(f.cause in REWORDED.values() for f in error.failures), error.failures
        return decision

    @property
    def actions(self) -> list[tuple[set[FailureKind], Action]]:
        return [(kinds, decision.action) for kinds, decision in self.seen]


DECIDE = relaunch.decide


def _reword(client: distributed.Client, monkeypatch: pytest.MonkeyPatch) -> Decisions:
    for name, text in REWORDED.items():
        monkeypatch.setitem(wording.MESSAGES, name, text)
    client.register_plugin(Reworded())
    decisions = Decisions()
    monkeypatch.setattr(relaunch, "decide", decisions.record)
    return decisions


def _assert_reworded(*texts: str) -> None:
    for text in texts:
        assert not any(words in text for words in ORIGINAL_WORDS), text
        assert "qx" in text, text


@pytest.fixture(scope="module")
def two_workers() -> Iterator[distributed.Client]:
    with local_cluster(2) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        yield client


@pytest.fixture
def client(
    two_workers: distributed.Client, monkeypatch: pytest.MonkeyPatch
) -> Iterator[distributed.Client]:
    two_workers.wait_for_workers(2, timeout=120)  # a test before may have replaced one
    yield two_workers
    two_workers.unregister_worker_plugin(Reworded.name)


def _raises_before_training(ctx: RankContext, marker_dir: str) -> None:
    (Path(marker_dir) / f"attempt-{ctx.launch_id}-rank{ctx.rank}").touch()
    raise ValueError("hidden_size=0: cannot build the model")


def test_the_same_failure_before_training_is_given_up_on(client, monkeypatch, tmp_path):
    decisions = _reword(client, monkeypatch)
    with pytest.raises(RepeatedFailure) as info:
        launch_with_restarts(
            client, _raises_before_training, str(tmp_path), world_size=2, timeout_s=30,
            max_restarts=3,
        )  # fmt: skip
    assert len({p.name.split("-rank")[0] for p in tmp_path.iterdir()}) == 2, "two attempts"
    assert [action for _, action in decisions.actions] == [
        Action.RELAUNCH,
        Action.GIVE_UP_REPEATED,
    ]
    for kinds, _ in decisions.seen:
        assert K.RAISED in kinds and kinds <= {K.RAISED, K.FOLLOW_ON}, kinds
    _assert_reworded(str(info.value).split(" (attempts")[0])


def _exits_once_mid_training(ctx: RankContext, marker_dir: str) -> int:
    """Steps with an all-reduce each; rank 1's worker process exits at step 5 of the first
    attempt (as after SIGKILL), so rank 0's next all-reduce fails."""
    marker = Path(marker_dir) / "exited"
    for step in range(1, 21):
        dist.all_reduce(torch.ones(1))
        ctx.heartbeat(step)
        if step == 5 and ctx.rank == 1 and not marker.exists():
            marker.touch()
            os._exit(1)
        time.sleep(0.05)
    return ctx.rank


def test_a_lost_worker_is_healed_and_the_group_relaunched(client, monkeypatch, tmp_path):
    decisions = _reword(client, monkeypatch)
    results, restarts = launch_with_restarts(
        client, _exits_once_mid_training, str(tmp_path), world_size=2, timeout_s=30
    )
    assert results == [0, 1] and len(restarts) == 1
    ((kinds, decision),) = decisions.seen
    assert K.WORKER_LOST in kinds and kinds <= {K.WORKER_LOST, K.FOLLOW_ON}, kinds
    assert decision.action is Action.RELAUNCH and decision.leavers == ()
    assert restarts[0].lost_workers, "the exited worker's address is gone"
    _assert_reworded(restarts[0].cause, *restarts[0].failed_ranks)


def _steps_then_hangs(ctx: RankContext) -> int:
    for step in range(1, 4):
        time.sleep(0.1)
        ctx.heartbeat(step)
    time.sleep(120)
    return ctx.rank


def test_a_stalled_rank_fails_its_group_and_no_restart_is_left(client, monkeypatch):
    decisions = _reword(client, monkeypatch)
    with pytest.raises(RestartsExhausted) as info:
        launch_with_restarts(client, _steps_then_hangs, world_size=1, timeout_s=5, max_restarts=0)
    assert decisions.actions == [({K.STALLED}, Action.GIVE_UP_EXHAUSTED)]
    _assert_reworded(str(info.value).split(" (no restart left")[0])


def _returns_rank(ctx: RankContext) -> int:
    return ctx.rank


@pytest.mark.timeout(180)
def test_a_rank_whose_worker_does_not_answer_did_not_start(client, monkeypatch):
    decisions = _reword(client, monkeypatch)
    # Registered while every worker answers: the launch registers them again, which a
    # stopped worker would hold up.
    client.register_plugin(GracefulStop())
    client.register_plugin(GracefulNannyStop())
    pids = client.run(os.getpid)
    hung = sorted(pids)[1]
    os.kill(pids[hung], signal.SIGSTOP)
    try:
        with pytest.raises(RestartsExhausted):
            launch_with_restarts(
                client, _returns_rank, world_size=2, timeout_s=30, max_restarts=0,
                supervision=SupervisionConfig(start_ask_timeout_s=3.0),
            )  # fmt: skip
    finally:
        os.kill(pids[hung], signal.SIGCONT)
    assert decisions.actions == [({K.DID_NOT_START}, Action.GIVE_UP_EXHAUSTED)]


STEPS, STEP_S = 300, 0.05  # a control step every second


def _start(pool: concurrent.futures.Executor, client: distributed.Client, state: Path, **kw):  # noqa: ANN003, ANN202
    return pool.submit(
        launch_with_restarts, client, steps_until_asked, str(state), STEPS, STEP_S,
        timeout_s=60, **kw,
    )  # fmt: skip


def _worker_after_a_control_step(state: Path, rank: int) -> str:
    deadline = time.monotonic() + 120
    step = state / f"rank{rank}-step"
    while not step.exists() or int(step.read_text() or 0) <= CONTROL_EVERY:
        assert time.monotonic() < deadline, "the group made no steps"
        time.sleep(0.05)
    return (state / f"rank{rank}-worker").read_text()


def test_a_retired_worker_s_group_stops_first_then_relaunches(monkeypatch, tmp_path):
    with (
        local_cluster(3) as cluster,
        distributed.Client(cluster) as client,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        client.wait_for_workers(3, timeout=120)
        decisions = _reword(client, monkeypatch)
        group = _start(pool, client, tmp_path, world_size=2, max_restarts=1)
        address = _worker_after_a_control_step(tmp_path, 1)
        assert address in client.retire_workers([address])
        results, restarts = group.result(timeout=180)
    stopped = int((tmp_path / "stopped-at").read_text())
    assert results == [stopped, stopped], "the relaunch resumed from the stop's step"
    ((kinds, decision),) = decisions.seen
    assert kinds == {K.PREEMPTED, K.PEER_STOPPED}, kinds
    assert decision.action is Action.RELAUNCH and decision.leavers == (address,)
    assert len(restarts) == 1
    _assert_reworded(restarts[0].cause, *restarts[0].failed_ranks)


def test_a_worker_that_joins_and_stays_grows_the_group_without_a_restart(monkeypatch, tmp_path):
    resizes: list[Resize] = []
    with (
        local_cluster(2) as cluster,
        distributed.Client(cluster) as client,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        client.wait_for_workers(2, timeout=120)
        decisions = _reword(client, monkeypatch)
        group = _start(
            pool, client, tmp_path, min_workers=2, max_workers=3, settle_s=1.0,
            on_resize=resizes.append,
        )  # fmt: skip
        _worker_after_a_control_step(tmp_path, 1)
        cluster.scale(3)
        results, restarts = group.result(timeout=180)
    stopped = int((tmp_path / "stopped-at").read_text())
    assert results == [stopped] * 3, "three ranks resumed from the grow's stop"
    assert restarts == [], "a grow spends no restart"
    assert [(r.old_size, r.new_size, r.reason) for r in resizes] == [(2, 3, "joined")]
    ((kinds, decision),) = decisions.seen
    assert K.GROW in kinds and kinds <= {K.GROW, K.PEER_STOPPED}, kinds
    assert decision.action is Action.GROW
