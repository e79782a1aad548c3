"""What the restart logic compares between attempts, and what a rank's heartbeat records."""

from __future__ import annotations

import time

import distributed
import pytest
import torch

from ddpflow.distributed.context import RankContext
from ddpflow.distributed.elastic import WorkersNotBack, _next_world_size, failure_causes
from ddpflow.distributed.failures import LaunchError, RankFailure, describe, root_causes_first
from ddpflow.distributed.supervision import WORKER_LEFT
from ddpflow.distributed.watchdog import rank_progress, rank_started

pytestmark = pytest.mark.integration


def _error(*causes: str) -> LaunchError:
    failures = [RankFailure(r, f"tcp://127.0.0.1:{40000 + r}", c) for r, c in enumerate(causes)]
    return LaunchError("DDP group failed", failures)


def test_one_failure_reads_the_same_in_every_attempt():
    first = _error(
        "ValueError: hidden_size=0 cannot build an LSTM",
        "RuntimeError: Connection closed by peer [127.0.0.1]:41234 (process 812)",
    )
    second = _error(
        "ValueError: hidden_size=0 cannot build an LSTM",
        "RuntimeError: Connection closed by peer [127.0.0.1]:50007 (process 977)",
    )
    assert failure_causes(first) == failure_causes(second)
    elsewhere = _error("its worker tcp://10.0.0.5:39001 did not answer cuda_available()")
    again = _error("its worker tcp://10.0.0.6:42111 did not answer cuda_available()")
    assert failure_causes(elsewhere) == failure_causes(again)


def test_different_failures_stay_different():
    assert not failure_causes(_error("ValueError: bad config")) & failure_causes(
        _error("OSError: corpus not found")
    )


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
    RankContext(0, 1, torch.device("cpu"), "none").heartbeat()  # e.g. evaluation in the flow


def test_workers_that_do_not_come_back_are_named_with_the_fix():
    # docs/multi-host.md "When a host fails": without --min-workers, a run whose workers do
    # not come back fails naming the heal timeout and --min-workers (not Dask's bare timeout).
    with (
        distributed.LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster,
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
    left, or the rank that raised), then its peers' follow-on errors."""
    peer_error = "DistBackendError: [gloo] read: Connection reset by peer ... GLHF"
    lost = [RankFailure(0, "tcp://a:1", peer_error), RankFailure(1, "tcp://b:2", WORKER_LEFT)]
    first = f"DDP group failed: rank 1 on worker tcp://b:2: {WORKER_LEFT}; rank 0"
    assert describe("failed", lost).startswith(first)
    raised = [
        RankFailure(0, "tcp://a:1", "DistStoreError: wait timed out after 120s"),
        RankFailure(1, "tcp://b:2", "ValueError: bad batch"),
        RankFailure(2, "tcp://c:3", "task cancelled"),
    ]
    assert [f.rank for f in root_causes_first(raised)] == [1, 0, 2]
