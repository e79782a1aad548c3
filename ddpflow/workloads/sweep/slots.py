"""Which trial runs on which Dask workers: free workers are handed out k at a time.

A trial holds its workers for its whole DDP group and gives them back when it ends (also on
failure), so the cluster never runs more trials than it can hold and the rest queue.

Workers come and go: one that dies is brought back by its nanny at a new address. With
`current` (the cluster's eligible workers now), the pool follows: a worker that left is never
handed out again and a new one joins the free workers, so one lost worker costs at most the
trial that was running on it, not every later trial placed on its old address.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
RECHECK_S = 1.0  # how often a waiting acquire looks for workers that (re)joined
SHRUNK_WAIT_S = 600.0  # how long a trial waits for a smaller cluster to regrow


class WorkerSlots:
    """A thread-safe pool of worker addresses; `acquire(k)` blocks until k are free."""

    def __init__(self, workers: Sequence[str], current: Callable[[], Sequence[str]] | None = None):
        if not workers:
            raise ValueError("a sweep needs at least one Dask worker")
        self._all = set(workers)  # in the cluster now
        self._known = set(workers)  # ever in the pool (release checks against it)
        self._capacity = len(self._all)
        self._free = sorted(self._all)
        self._current = current
        self._cond = threading.Condition()

    @property
    def capacity(self) -> int:
        """The cluster's size when the sweep started; it plans the number of trials at once."""
        return self._capacity

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
        started = time.monotonic()
        with self._cond:
            while True:
                self._follow_cluster()
                if len(self._free) >= k:
                    taken, self._free = self._free[:k], self._free[k:]
                    return taken
                waited = time.monotonic() - started
                if timeout_s is not None and waited >= timeout_s:
                    raise TimeoutError(f"no {k} free workers within {timeout_s}s")
                if len(self._all) < k and waited >= SHRUNK_WAIT_S:
                    raise TimeoutError(
                        f"a trial needs {k} workers but only {len(self._all)} of the "
                        f"{self.capacity} the sweep started with came back within "
                        f"{SHRUNK_WAIT_S:g}s: {sorted(self._all)}"
                    )
                remaining = None if timeout_s is None else timeout_s - waited
                if self._current is not None:  # look again for workers that (re)joined
                    remaining = RECHECK_S if remaining is None else min(RECHECK_S, remaining)
                self._cond.wait(remaining)

    def release(self, workers: Sequence[str]) -> None:
        with self._cond:
            foreign = set(workers) - self._known
            busy_again = set(workers) & set(self._free)
            if foreign or busy_again:
                raise ValueError(f"cannot release {sorted(foreign | busy_again)}: not held")
            # A worker that left the cluster while held is not handed out again.
            self._free = sorted([*self._free, *(w for w in workers if w in self._all)])
            self._follow_cluster()
            self._cond.notify_all()

    def _follow_cluster(self) -> None:
        """Drop workers that left the cluster, add new ones as free (lock held)."""
        if self._current is None:
            return
        now = set(self._current())
        joined = now - self._known
        self._all = (self._all & now) | joined
        self._known |= joined
        self._free = sorted((set(self._free) & now) | joined)

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
