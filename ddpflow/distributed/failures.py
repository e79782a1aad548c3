"""How a rank group's failure is described: which rank, on which worker, and why."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


def describe(verb: str, failures: Sequence[RankFailure]) -> str:
    lines = [f"rank {f.rank} on worker {f.worker_address}: {f.cause}" for f in failures]
    return f"DDP group {verb}: " + "; ".join(lines)
