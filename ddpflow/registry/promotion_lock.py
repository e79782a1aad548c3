"""What a promotion asks of its lock, whoever provides it.

The lock ddpflow's flows use is a Prefect global concurrency limit with a lease
(`ddpflow.integrations.prefect.promotion_limit`); the library below the Prefect integration
never imports Prefect, so a promotion only knows this interface. A lock is a callable
`(tracking URI, model name)` that returns a context manager holding the model's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class PromotionLockLost(RuntimeError):
    """The lock may be someone else's now: its holder must not act any more."""


class HeldLock(Protocol):
    def ensure_held(self) -> None:
        """Raise PromotionLockLost unless the lock stays ours for a while yet (a lease)."""


PromotionLock = Callable[[str, str], AbstractContextManager[HeldLock]]


class _NotLocked:
    def ensure_held(self) -> None:
        """Nothing to lose."""


NOT_LOCKED: HeldLock = _NotLocked()


@contextmanager
def unlocked(tracking_uri: str, model_name: str) -> Iterator[HeldLock]:
    """No lock: for a promoter known to be alone (a test, one user's registry file). The
    alias is still read again right before it is set."""
    yield NOT_LOCKED
