"""What the launcher does after a rank group stopped: a function of its failures' kinds.

Each kind's part (RULES below is this table in code):

| kind          | in a grow   | its worker          | compared between attempts |
|---------------|-------------|---------------------|---------------------------|
| raised        | blocks it   |                     | yes                       |
| worker lost   | blocks it   |                     | yes                       |
| preempted     | blocks it   | is waited for to go | yes                       |
| grow          | asks for it |                     | yes                       |
| peer stopped  | goes along  |                     | no: a peer's consequence  |
| stalled       | blocks it   |                     | yes                       |
| follow-on     | blocks it   |                     | no: a peer's consequence  |
| did not start | blocks it   |                     | yes                       |

The group's next step, from all its failures; the first that applies (`decide`):

| step                     | when                                              | spends a restart |
|--------------------------|---------------------------------------------------|------------------|
| grow                     | the grow watch asked, one failure asks, none blocks | no             |
| give up: repeated        | no training step yet, and a compared failure has  | -                |
|                          | the kind and exception type of one of the last    |                  |
|                          | attempt, which also failed before training        |                  |
| give up: no restart left | `max_restarts` are spent                          | -                |
| relaunch                 | otherwise: heal, wait for the leavers to go, go   | yes              |
|                          | on with the workers there are (a shrink, down to  |                  |
|                          | `min_workers`, where fewer came back)             |                  |

A relaunch's change of size reads "preempted" when a failure's worker was asked to leave,
else "lost"; a grow's reads "joined".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ddpflow.distributed.supervisor.failures import FailureKind, LaunchError, RankFailure


class Grow(enum.Enum):
    """A failed rank's part in deciding whether its group only stopped to grow."""

    ASKS = "asks"  # it stopped for the grow
    GOES_ALONG = "goes along"  # it stopped with its group: neither asks for a grow nor blocks one
    BLOCKS = "blocks"  # a failure: the group did not just grow


@dataclass(frozen=True)
class Rule:
    grow: Grow
    # Its worker was asked to leave (SIGTERM, retired, its nanny closing): the relaunch waits
    # until it has gone, since one that took it again would fail when it does.
    leaver: bool
    # Part of "the same failure twice": not merely a consequence of another rank's failure.
    compared: bool


RULES: Mapping[FailureKind, Rule] = MappingProxyType(
    {
        FailureKind.RAISED: Rule(Grow.BLOCKS, leaver=False, compared=True),
        FailureKind.WORKER_LOST: Rule(Grow.BLOCKS, leaver=False, compared=True),
        FailureKind.PREEMPTED: Rule(Grow.BLOCKS, leaver=True, compared=True),
        FailureKind.GROW: Rule(Grow.ASKS, leaver=False, compared=True),
        FailureKind.PEER_STOPPED: Rule(Grow.GOES_ALONG, leaver=False, compared=False),
        FailureKind.STALLED: Rule(Grow.BLOCKS, leaver=False, compared=True),
        FailureKind.FOLLOW_ON: Rule(Grow.BLOCKS, leaver=False, compared=False),
        FailureKind.DID_NOT_START: Rule(Grow.BLOCKS, leaver=False, compared=True),
    }
)


class Action(enum.Enum):
    GROW = "grow"  # relaunch at the larger size the grow watch found
    RELAUNCH = "relaunch"  # heal the cluster and relaunch on the workers there are
    GIVE_UP_REPEATED = "give up: repeated"  # deterministic: restarting will not help
    GIVE_UP_EXHAUSTED = "give up: no restart left"


# A failure as "the same failure twice" compares it: its kind and its exception's type.
Signature = tuple[FailureKind, str | None]


@dataclass(frozen=True)
class Decision:
    action: Action
    # This attempt's compared failures, for the next attempt to be compared with: empty once
    # training started (a failure after a step is not deterministic) and after a grow.
    signatures: frozenset[Signature] = frozenset()
    repeated: RankFailure | None = None  # GIVE_UP_REPEATED: the failure seen twice
    leavers: tuple[str, ...] = ()  # workers asked to leave: the relaunch waits until they have
    resize_reason: str = "lost"  # how a change of the group's size is reported

    @property
    def spends_restart(self) -> bool:
        return self.action is Action.RELAUNCH


def decide(
    error: LaunchError,
    *,
    grow_asked: bool,
    previous: frozenset[Signature],
    restarts_used: int,
    max_restarts: int,
) -> Decision:
    """The group's next step after `error` (the module's second table). `grow_asked`: the grow
    watch asked this group to stop; `previous`: the last attempt's Decision.signatures."""
    failures = error.failures
    if grow_asked and is_grow(failures):
        return Decision(Action.GROW, resize_reason="joined")
    signatures = frozenset() if error.training_started else _signatures(failures)
    if not error.training_started:
        for failure in _compared(failures):
            if _signature(failure) in previous:
                return Decision(Action.GIVE_UP_REPEATED, signatures, repeated=failure)
    if restarts_used >= max_restarts:
        return Decision(Action.GIVE_UP_EXHAUSTED, signatures)
    leavers = tuple(sorted({f.worker_address for f in failures if RULES[f.kind].leaver}))
    return Decision(
        Action.RELAUNCH,
        signatures,
        leavers=leavers,
        resize_reason="preempted" if leavers else "lost",
    )


def is_grow(failures: Sequence[RankFailure]) -> bool:
    """Whether the group's failures are only its ranks stopping for a grow."""
    votes = {RULES[f.kind].grow for f in failures}
    return Grow.ASKS in votes and Grow.BLOCKS not in votes


def _compared(failures: Sequence[RankFailure]) -> list[RankFailure]:
    """The failures "the same failure twice" compares: the root ones, or, where every rank
    only followed another's failure (the group's store gone), all of them."""
    return [f for f in failures if RULES[f.kind].compared] or list(failures)


def _signatures(failures: Sequence[RankFailure]) -> frozenset[Signature]:
    return frozenset(_signature(f) for f in _compared(failures))


def _signature(failure: RankFailure) -> Signature:
    return failure.kind, failure.error_type
