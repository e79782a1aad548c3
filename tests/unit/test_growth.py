"""The grow watch's decisions (ddpflow.distributed.supervisor.growth), on a clock of the test's own:
who has settled, how large the group grows, and which failures are a grow's stop. The
integration tier runs them on real joining workers (integration/test_elastic_grow.py)."""

from __future__ import annotations

from ddpflow.distributed.supervisor.failures import FailureKind, RankFailure
from ddpflow.distributed.supervisor.growth import JoinTracker, grow_target
from ddpflow.distributed.supervisor.policy import is_grow

GROUP = ["tls://a:1", "tls://b:1"]


def test_a_newcomer_settles_after_settle_s_without_a_break():
    tracker = JoinTracker(settle_s=10)
    assert tracker.settled(GROUP, [*GROUP, "tls://c:1"], now=0) == []
    assert tracker.settled(GROUP, [*GROUP, "tls://c:1"], now=9.9) == []
    assert tracker.settled(GROUP, [*GROUP, "tls://c:1"], now=10) == ["tls://c:1"]


def test_a_worker_that_leaves_within_settle_s_starts_again_when_it_returns():
    tracker = JoinTracker(settle_s=10)
    tracker.settled(GROUP, [*GROUP, "tls://c:1"], now=0)
    assert tracker.settled(GROUP, GROUP, now=5) == []  # gone: forgotten
    assert tracker.settled(GROUP, [*GROUP, "tls://c:1"], now=11) == []  # back: from now on
    assert tracker.settled(GROUP, [*GROUP, "tls://c:1"], now=21) == ["tls://c:1"]


def test_the_group_s_own_workers_never_count_as_newcomers():
    tracker = JoinTracker(settle_s=0)
    assert tracker.settled(GROUP, GROUP, now=100) == []


def test_the_group_grows_by_its_settled_newcomers_up_to_max_workers():
    assert grow_target(2, 0, 4) is None
    assert grow_target(2, 1, 4) == 3
    assert grow_target(2, 5, 4) == 4
    assert grow_target(4, 1, 4) is None


def _stopped(*kinds: FailureKind) -> list[RankFailure]:
    return [RankFailure(r, f"tls://w{r}:1", kind, "") for r, kind in enumerate(kinds)]


def test_only_a_stop_that_every_rank_took_for_a_grow_is_one():
    grew, peer = FailureKind.GROW, FailureKind.PEER_STOPPED
    assert is_grow(_stopped(grew, grew))
    assert is_grow(_stopped(grew, peer))
    assert not is_grow(_stopped(peer, peer)), "no rank named the grow: someone else asked"
    assert not is_grow(_stopped(grew, FailureKind.FOLLOW_ON))
    assert not is_grow(_stopped(grew, FailureKind.PREEMPTED)), "a worker leaves as well"
    assert not is_grow([])
