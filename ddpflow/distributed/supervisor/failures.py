"""How a rank group's failure is described: which rank, on which worker, of which kind, and why.

A failure's kind is set where it is detected (a rank's exception where the launcher reads it,
a lost worker where the launcher sees it gone, a stall where the step watch measures it) and
is what the restart policy reads (policy.py). Its cause is the words for people (wording.py);
nothing decides on them, and this module imports none (pyproject.toml's import contracts).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class FailureKind(enum.Enum):
    """Why one rank of a group stopped."""

    RAISED = "raised"  # the rank's own function raised
    WORKER_LOST = "worker lost"  # its worker died or left the cluster unasked
    PREEMPTED = "preempted"  # its worker was asked to leave (SIGTERM, retired, nanny closing)
    GROW = "grow"  # the group stopped at a checkpoint to grow onto workers that joined
    PEER_STOPPED = "peer stopped"  # stopped with its group because a peer was asked to
    STALLED = "stalled"  # no training step for longer than the timeout (the step watch)
    FOLLOW_ON = "follow-on"  # a peer's failure reached it: a connection reset, a cancelled rank
    DID_NOT_START = "did not start"  # its rank never started: the worker busy, hung or gone


# The order causes are named in: the worker's fate first (it explains the rest), then what a
# rank did on its own, then what only followed from another rank's failure.
_NAMED = {
    FailureKind.DID_NOT_START: 0,
    FailureKind.WORKER_LOST: 0,
    FailureKind.PREEMPTED: 0,
    FailureKind.RAISED: 1,
    FailureKind.STALLED: 1,
    FailureKind.GROW: 1,
    FailureKind.PEER_STOPPED: 2,
    FailureKind.FOLLOW_ON: 2,
}


def is_consequence(kind: FailureKind) -> bool:
    """Whether a failure of this kind only followed from another rank's."""
    return _NAMED[kind] == 2


@dataclass(frozen=True)
class RankFailure:
    rank: int
    worker_address: str
    kind: FailureKind
    cause: str  # for people (wording.py); no decision reads it
    # The rank's exception type (module.qualname), where it raised one: two attempts that
    # failed the same way failed with the same kinds and types.
    error_type: str | None = None


class LaunchError(RuntimeError):
    """A rank group failed; `failures` names each failed rank, its worker, kind and cause.

    `training_started` says whether any rank had made a training step: a failure before the
    first step that repeats is deterministic, and restarting will not help.
    """

    def __init__(
        self, message: str, failures: Sequence[RankFailure], training_started: bool = False
    ):
        super().__init__(message)
        self.failures = list(failures)
        self.training_started = training_started


def root_causes_first(failures: Sequence[RankFailure]) -> list[RankFailure]:
    """The failures in the order a person reads them: a worker that left (or never started
    its rank) first, then ranks that failed on their own, then their peers' follow-on
    errors; by rank within each."""
    return sorted(failures, key=lambda f: (_NAMED[f.kind], f.rank))
