"""The restart policy, kind by kind (ddpflow.distributed.supervisor.policy): what the launcher
does after a group fails with a failure of each kind, read off one table."""

from __future__ import annotations

import pytest

from ddpflow.distributed.supervisor.failures import FailureKind, LaunchError, RankFailure
from ddpflow.distributed.supervisor.policy import RULES, Action, Decision, decide

K = FailureKind
WORKER = "tcp://10.0.0.1:4000"

# kind: (its group's step with the grow watch asking, spends a restart, waits for its worker
# to leave, resize reason, the step when the same failure comes again before training).
EXPECTED = {
    K.RAISED: (Action.RELAUNCH, True, False, "lost", Action.GIVE_UP_REPEATED),
    K.WORKER_LOST: (Action.RELAUNCH, True, False, "lost", Action.GIVE_UP_REPEATED),
    K.PREEMPTED: (Action.RELAUNCH, True, True, "preempted", Action.GIVE_UP_REPEATED),
    K.GROW: (Action.GROW, False, False, "joined", Action.GROW),
    K.PEER_STOPPED: (Action.RELAUNCH, True, False, "lost", Action.GIVE_UP_REPEATED),
    K.STALLED: (Action.RELAUNCH, True, False, "lost", Action.GIVE_UP_REPEATED),
    K.FOLLOW_ON: (Action.RELAUNCH, True, False, "lost", Action.GIVE_UP_REPEATED),
    K.DID_NOT_START: (Action.RELAUNCH, True, False, "lost", Action.GIVE_UP_REPEATED),
}


def _failed(*kinds: FailureKind, training_started: bool = False) -> LaunchError:
    failures = [
        RankFailure(rank, WORKER if rank == 0 else f"tcp://10.0.0.2:{rank}", kind, "", "T")
        for rank, kind in enumerate(kinds)
    ]
    return LaunchError("", failures, training_started)


def _decide(error: LaunchError, previous: Decision | None = None, **kwargs: object) -> Decision:
    options: dict = {"grow_asked": True, "restarts_used": 0, "max_restarts": 2, **kwargs}
    before = previous.signatures if previous is not None else frozenset()
    return decide(error, previous=before, **options)


def test_every_kind_has_a_rule_and_an_expectation():
    assert set(RULES) == set(FailureKind) == set(EXPECTED)


@pytest.mark.parametrize("kind", list(FailureKind), ids=lambda k: k.value)
def test_the_policy_for_each_kind(kind: FailureKind):
    step, spends, waits, resize, again = EXPECTED[kind]
    decision = _decide(_failed(kind))
    assert decision.action is step
    assert decision.spends_restart is spends
    assert decision.leavers == ((WORKER,) if waits else ())
    assert decision.resize_reason == resize
    assert _decide(_failed(kind), previous=decision).action is again


@pytest.mark.parametrize("kind", list(FailureKind), ids=lambda k: k.value)
def test_a_failure_after_training_started_is_never_deterministic(kind: FailureKind):
    first = _decide(_failed(kind, training_started=True))
    assert first.signatures == frozenset()
    again = _decide(_failed(kind), previous=first).action
    assert again is (Action.GROW if kind is K.GROW else Action.RELAUNCH)


@pytest.mark.parametrize("kind", [k for k in FailureKind if k is not K.GROW], ids=str)
def test_with_no_restart_left_the_launcher_gives_up(kind: FailureKind):
    decision = _decide(_failed(kind, training_started=True), restarts_used=2, max_restarts=2)
    assert decision.action is Action.GIVE_UP_EXHAUSTED


def test_a_grow_spends_no_restart_even_with_none_left():
    decision = _decide(_failed(K.GROW, K.PEER_STOPPED), restarts_used=2, max_restarts=2)
    assert decision.action is Action.GROW and not decision.spends_restart


@pytest.mark.parametrize(
    ("kinds", "grow_asked", "step"),
    [
        ((K.GROW, K.GROW), True, Action.GROW),
        ((K.GROW, K.PEER_STOPPED), True, Action.GROW),
        ((K.GROW, K.GROW), False, Action.RELAUNCH),  # the watch did not ask: someone else
        ((K.PEER_STOPPED, K.PEER_STOPPED), True, Action.RELAUNCH),
        ((K.GROW, K.FOLLOW_ON), True, Action.RELAUNCH),  # a peer failed meanwhile
        ((K.GROW, K.PREEMPTED), True, Action.RELAUNCH),  # a worker leaves as well
    ],
)
def test_a_group_grows_only_when_every_rank_stopped_for_the_grow(kinds, grow_asked, step):
    assert _decide(_failed(*kinds), grow_asked=grow_asked).action is step


def test_a_peer_s_consequence_is_not_compared_when_a_root_failure_is_there():
    first = _decide(_failed(K.RAISED, K.FOLLOW_ON))
    second = _failed(K.FOLLOW_ON, K.STALLED)
    assert _decide(second, previous=first).action is Action.RELAUNCH
    assert _decide(_failed(K.FOLLOW_ON, K.RAISED), previous=first).action is (
        Action.GIVE_UP_REPEATED
    )
