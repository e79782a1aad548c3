"""Which trial runs on which Dask workers: free workers are handed out k at a time.

A trial holds its workers for its whole DDP group and gives them back when it ends (also on
failure), so the cluster never runs more trials than it can hold and the rest queue.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class WorkerSlots:
    """A thread-safe pool of worker addresses; `acquire(k)` blocks until k are free."""

    def __init__(self, workers: Sequence[str]):
        if not workers:
            raise ValueError("a sweep needs at least one Dask worker")
        self._all = frozenset(workers)
        self._free = sorted(self._all)
        self._cond = threading.Condition()

    @property
    def capacity(self) -> int:
        return len(self._all)

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def max_concurrent(self, ranks_per_trial: int) -> int:
        return self.capacity // ranks_per_trial

    def acquire(self, k: int, timeout_s: float | None = None) -> list[str]:
        """Take k free workers (lowest addresses first, so assignments are reproducible)."""
        if not 1 <= k <= self.capacity:
            raise ValueError(f"a trial of {k} ranks cannot fit on {self.capacity} workers")
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= k, timeout=timeout_s):
                raise TimeoutError(f"no {k} free workers within {timeout_s}s")
            taken, self._free = self._free[:k], self._free[k:]
            return taken

    def release(self, workers: Sequence[str]) -> None:
        with self._cond:
            foreign = set(workers) - self._all
            busy_again = set(workers) & set(self._free)
            if foreign or busy_again:
                raise ValueError(f"cannot release {sorted(foreign | busy_again)}: not held")
            self._free = sorted([*self._free, *workers])
            self._cond.notify_all()

    @contextmanager
    def hold(self, k: int) -> Iterator[list[str]]:
        workers = self.acquire(k)
        try:
            yield workers
        finally:
            self.release(workers)


def run_queued(
    items: Sequence[T],
    slots: WorkerSlots,
    ranks_per_item: int,
    fn: Callable[[T, list[str]], R],
) -> list[R]:
    """Run `fn(item, workers)` for every item, as many at once as the slots hold.

    Items start in order as workers free up; results come back in item order. `fn` should
    turn its own failures into results: an exception escaping it is re-raised here after
    the items already running have finished.
    """
    num_threads = max(1, min(len(items), slots.max_concurrent(ranks_per_item)))

    def one(item: T) -> R:
        with slots.hold(ranks_per_item) as workers:
            return fn(item, workers)

    with ThreadPoolExecutor(num_threads, thread_name_prefix="ddpflow-trial") as pool:
        # Each thread sees a copy of the caller's context variables (e.g. a running
        # Prefect flow's), which a plain executor thread would not.
        futures = [pool.submit(contextvars.copy_context().run, one, item) for item in items]
        return [f.result() for f in futures]
