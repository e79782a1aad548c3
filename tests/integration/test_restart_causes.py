"""What the restart logic compares between attempts, the order causes are named in, and what
a rank's heartbeat records."""

from __future__ import annotations

import time

import distributed
import pytest
import torch

from ddpflow.cluster.build import LOOPBACK_DASHBOARD
from ddpflow.distributed.context import RankContext
from ddpflow.distributed.supervisor.failures import (
    FailureKind,
    LaunchError,
    RankFailure,
    root_causes_first,
)
from ddpflow.distributed.supervisor.heartbeats import rank_progress, rank_started
from ddpflow.distributed.supervisor.policy import Action, Signature, decide
from ddpflow.distributed.supervisor.relaunch import WorkersNotBack, _next_world_size
from ddpflow.distributed.supervisor.wording import describe, words

pytestmark = pytest.mark.integration


RAISED, FOLLOW_ON = FailureKind.RAISED, FailureKind.FOLLOW_ON
WORKER_LEFT = words("worker_left")


def _error(*failures: tuple[FailureKind, str, str | None]) -> LaunchError:
    """A group failed before training: rank r failed with failures[r] (kind, cause, type)."""
    ranks = [
        RankFailure(r, f"tcp://127.0.0.1:{40000 + r}", kind, cause, error_type)
        for r, (kind, cause, error_type) in enumerate(failures)
    ]
    return LaunchError("DDP group failed", ranks)


def _after(error: LaunchError, previous: frozenset[Signature]) -> Action:
    return decide(
        error, grow_asked=False, previous=previous, restarts_used=1, max_restarts=5
    ).action


def _signatures(error: LaunchError) -> frozenset[Signature]:
    return decide(
        error, grow_asked=False, previous=frozenset(), restarts_used=0, max_restarts=5
    ).signatures


def test_one_failure_is_the_same_in_every_attempt_whatever_its_words():
    first = _error(
        (RAISED, "ValueError: hidden_size=0 cannot build an LSTM", "builtins.ValueError"),
        (FOLLOW_ON, "RuntimeError: Connection closed by peer [127.0.0.1]:41234", "RuntimeError"),
    )
    second = _error(
        (RAISED, "ValueError: hidden_size=-1 is not a size", "builtins.ValueError"),
        (FOLLOW_ON, "RuntimeError: Connection reset by peer [127.0.0.1]:50007", "RuntimeError"),
    )
    assert _signatures(first) == _signatures(second)
    assert _after(second, _signatures(first)) is Action.GIVE_UP_REPEATED
    elsewhere = _error((FailureKind.DID_NOT_START, "its worker tcp://10.0.0.5:39001", None))
    again = _error((FailureKind.DID_NOT_START, "worker tcp://10.0.0.6:42111 never came", None))
    assert _after(again, _signatures(elsewhere)) is Action.GIVE_UP_REPEATED


def test_different_failures_stay_different():
    bad_config = _error((RAISED, "ValueError: bad config", "builtins.ValueError"))
    no_corpus = _error((RAISED, "ValueError: bad config", "builtins.FileNotFoundError"))
    assert not _signatures(bad_config) & _signatures(no_corpus), "another exception type"
    assert _after(no_corpus, _signatures(bad_config)) is Action.RELAUNCH
    stalled = _error((FailureKind.STALLED, "ValueError: bad config", None))
    assert _after(stalled, _signatures(bad_config)) is Action.RELAUNCH, "another kind"


def test_a_peer_s_follow_on_error_alone_makes_no_repeat():
    """Two different root causes, each with the same gloo error on its peer: not the same
    failure (the peer only followed the root)."""
    first = _error(
        (RAISED, "ValueError: bad config", "builtins.ValueError"),
        (FOLLOW_ON, "RuntimeError: Connection closed by peer", "builtins.RuntimeError"),
    )
    second = _error(
        (FOLLOW_ON, "RuntimeError: Connection closed by peer", "builtins.RuntimeError"),
        (RAISED, "OSError: corpus not found", "builtins.OSError"),
    )
    assert _after(second, _signatures(first)) is Action.RELAUNCH


def test_a_heartbeat_is_recorded_on_the_worker_without_network():
    rank_started("launch-a", 0)
    time.sleep(0.05)
    ((age, beats),) = rank_progress("launch-a").values()
    assert beats == 0 and age >= 0.05
    ctx = RankContext(0, 1, torch.device("cpu"), "gloo", None, "launch-a")
    ctx.heartbeat()
    ctx.heartbeat()
    age, beats = rank_progress("launch-a")[0]
    assert beats == 2 and age < 0.05
    assert rank_progress("another-launch") == {}


def test_a_context_outside_a_launch_ignores_heartbeats():
    rank_started("launch-b", 0)
    ((_, beats_before),) = rank_progress("launch-b").values()
    RankContext(0, 1, torch.device("cpu"), "none").heartbeat()  # e.g. evaluation in the flow
    ((_, beats_after),) = rank_progress("launch-b").values()
    assert beats_before == beats_after == 0, "no launch watches it: nothing is recorded"


def test_workers_that_do_not_come_back_are_named_with_the_fix():
    # docs/multi-host.md "When a host fails": without --min-workers, a run whose workers do
    # not come back fails naming the heal timeout and --min-workers (not Dask's bare timeout).
    with (
        distributed.LocalCluster(
            n_workers=1, processes=False, dashboard_address=LOOPBACK_DASHBOARD
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        with pytest.raises(WorkersNotBack, match=r"only 1 of 2 were back within 0.5s") as info:
            _next_world_size(client, 2, None, 0.5)
        assert "DDPFLOW_HEAL_TIMEOUT_S" in str(info.value) and "--min-workers" in str(info.value)
        with pytest.raises(WorkersNotBack, match=r"min_workers=2 allows no fewer"):
            _next_world_size(client, 2, 2, 0.5)
        assert _next_world_size(client, 2, 1, 0.5) == 1, "min_workers=1 continues with one"


def test_the_first_cause_named_is_the_root_one_and_peers_follow():
    """docs/fault-tolerance.md: a failure's message opens with its cause (the worker that
    left, or the rank that raised), then its peers' follow-on errors; by kind, not words."""
    peer_error = "DistBackendError: [gloo] read: Connection reset by peer ... GLHF"
    lost = [
        RankFailure(0, "tcp://a:1", FOLLOW_ON, peer_error),
        RankFailure(1, "tcp://b:2", FailureKind.WORKER_LOST, WORKER_LEFT),
    ]
    first = f"DDP group failed: rank 1 on worker tcp://b:2: {WORKER_LEFT}; rank 0"
    assert describe("group_failed", lost).startswith(first)
    raised = [
        RankFailure(0, "tcp://a:1", FOLLOW_ON, "DistStoreError: wait timed out after 120s"),
        RankFailure(1, "tcp://b:2", RAISED, "ValueError: bad batch"),
        RankFailure(2, "tcp://c:3", FOLLOW_ON, "task cancelled"),
        RankFailure(3, "tcp://d:4", FailureKind.PEER_STOPPED, "another worker was asked"),
        RankFailure(4, "tcp://e:5", FailureKind.PREEMPTED, "worker tcp://e:5 asked to stop"),
    ]
    assert [f.rank for f in root_causes_first(raised)] == [4, 1, 0, 2, 3]
