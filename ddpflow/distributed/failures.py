"""How a rank group's failure is described: which rank, on which worker, and why."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# A rank's error that only reports a peer gone (its connection reset or closed, a collective
# or the store timing out on it) or the launcher cancelling it: the consequence of another
# failure, named after it.
_FOLLOW_ON = re.compile(
    r"connection (reset|closed) by peer|broken pipe|connection refused|timed out|"
    r"socket closed|cancelled",
    re.IGNORECASE,
)
_WORKER_GONE = re.compile(r"left the cluster|asked to stop|did not start")


@dataclass(frozen=True)
class RankFailure:
    rank: int
    worker_address: str
    cause: str


class LaunchError(RuntimeError):
    """A rank group failed; `failures` names each failed rank, its worker and the cause.

    `training_started` says whether any rank had made a training step: a failure before the
    first step that repeats identically is deterministic, and restarting will not help.
    """

    def __init__(
        self, message: str, failures: Sequence[RankFailure], training_started: bool = False
    ):
        super().__init__(message)
        self.failures = list(failures)
        self.training_started = training_started


def root_causes_first(failures: Sequence[RankFailure]) -> list[RankFailure]:
    """The failures in the order a person reads them: a worker that left (or never started
    its rank) first, then ranks that raised on their own, then their peers' follow-on errors;
    by rank within each."""

    def order(failure: RankFailure) -> tuple[int, int]:
        if _WORKER_GONE.search(failure.cause):
            return 0, failure.rank
        return (2 if _FOLLOW_ON.search(failure.cause) else 1), failure.rank

    return sorted(failures, key=order)


def describe(verb: str, failures: Sequence[RankFailure]) -> str:
    """One line, its first cause the root one (root_causes_first)."""
    lines = [
        f"rank {f.rank} on worker {f.worker_address}: {f.cause}"
        for f in root_causes_first(failures)
    ]
    return f"DDP group {verb}: " + "; ".join(lines)
