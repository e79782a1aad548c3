"""Step progress: each rank notes its steps on its own worker; the launcher asks for them.

A rank stuck outside a collective (in IO, say) fails nothing by itself: gloo's timeout only
fires in a rank that waits for a peer, and a group of one has no peer. So ranks note the time
of each step in their worker's memory (a dict write, no network per step), and the launcher
asks each running rank's worker, bounded, how long ago that was. A rank without progress for
longer than the group's timeout fails the group, as a collective timeout would.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import distributed

from ddpflow.distributed.planning import RankAssignment
from ddpflow.distributed.supervisor.failures import FailureKind, RankFailure
from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION
from ddpflow.distributed.supervisor.wording import words

MAX_KEPT = 64  # rank records kept per worker process (one per rank it ran)


@dataclass
class _Progress:
    last: float  # time.monotonic() of the rank's start or its latest heartbeat
    beats: int = 0
    first_step: int | None = None  # global training steps this attempt of the rank did
    last_step: int | None = None


_ranks: dict[tuple[str, int], _Progress] = {}  # worker-local: (launch id, rank) -> progress


@dataclass(frozen=True)
class _Binding:
    launch_id: str
    rank: int


# The rank this thread runs. Code far below the training function (a checkpoint write's
# retries) beats for its rank through this, without a context object passed down to it.
_this_thread = threading.local()


def bind_thread(launch_id: str, rank: int) -> None:
    """On the worker, in the rank's thread: this thread now runs `rank` of that group."""
    _this_thread.binding = _Binding(launch_id, rank)


def unbind_thread() -> None:
    _this_thread.binding = None


def beat_this_thread() -> None:
    """A heartbeat for the rank this thread runs; nothing outside a launched rank."""
    binding: _Binding | None = getattr(_this_thread, "binding", None)
    if binding is not None:
        heartbeat(binding.launch_id, binding.rank)


def rank_started(launch_id: str, rank: int) -> None:
    """On the worker: the rank begins (again); its first step is due within the timeout."""
    while len(_ranks) >= MAX_KEPT:
        del _ranks[next(iter(_ranks))]  # the oldest: its group ended long ago
    _ranks[(launch_id, rank)] = _Progress(time.monotonic())


def heartbeat(launch_id: str, rank: int, step: int | None = None) -> None:
    """On the worker: the rank made progress (a training step, a validation batch)."""
    progress = _ranks.get((launch_id, rank))
    if progress is not None:
        progress.last = time.monotonic()
        progress.beats += 1
        if step is not None:
            progress.first_step = step if progress.first_step is None else progress.first_step
            progress.last_step = step


def rank_steps() -> list[tuple[str, int, int | None, int | None]]:
    """On the worker: (launch id, rank, first step, last step) of each rank it ran, oldest
    first. What an attempt did before it failed, and where the next one started: the
    work a failure cost is their difference."""
    return [(lid, r, p.first_step, p.last_step) for (lid, r), p in _ranks.items()]


def rank_progress(launch_id: str) -> dict[int, tuple[float, int]]:
    """On the worker: rank -> (seconds since its last progress, heartbeats so far)."""
    now = time.monotonic()
    return {r: (now - p.last, p.beats) for (lid, r), p in _ranks.items() if lid == launch_id}


def ask_each(
    client: distributed.Client,
    fn: Callable[..., Any],
    *args: Any,
    workers: Sequence[str],
    timeout_s: float = DEFAULT_SUPERVISION.ask_timeout_s,
) -> dict[str, Any]:
    """`fn(*args)` on each worker at once, each call bounded: worker -> its answer.

    A worker that does not answer within `timeout_s`, or whose call raised, is missing from
    the result. Asked one by one, so one hung worker costs no other worker's answer.
    """
    if not workers:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(workers)) as pool:
        asks = {
            w: pool.submit(client.run, fn, *args, workers=[w], callback_timeout=timeout_s)
            for w in workers
        }
    return {w: ask.result()[w] for w, ask in asks.items() if ask.exception() is None}


class StepWatch:
    """The launcher's view of each rank's progress, refreshed by asking the workers."""

    def __init__(
        self,
        client: distributed.Client,
        plan: list[RankAssignment],
        launch_id: str,
        timeout_s: float,
        ask_timeout_s: float = DEFAULT_SUPERVISION.ask_timeout_s,
    ):
        self.client, self.plan, self.launch_id, self.timeout_s = client, plan, launch_id, timeout_s
        self.ask_timeout_s = ask_timeout_s
        now = time.monotonic()
        self.last = {a.rank: now for a in plan}  # this process's clock
        self.silent: set[int] = set()
        self.training_started = False

    def refresh(self, ranks: Sequence[RankAssignment]) -> None:
        workers = [a.worker_address for a in ranks]
        answers = ask_each(
            self.client,
            rank_progress,
            self.launch_id,
            workers=workers,
            timeout_s=self.ask_timeout_s,
        )
        now = time.monotonic()
        for a in ranks:
            progress = (answers.get(a.worker_address) or {}).get(a.rank)
            if progress is None:  # keep the last known time: a silent rank makes no progress
                self.silent.add(a.rank)
                continue
            self.silent.discard(a.rank)
            age, beats = progress
            self.last[a.rank] = now - age
            self.training_started = self.training_started or beats > 0

    def stalled(self, running: Sequence[RankAssignment]) -> list[RankFailure]:
        """The running ranks without progress for longer than the timeout."""
        self.refresh(running)
        now = time.monotonic()
        return [
            RankFailure(a.rank, a.worker_address, FailureKind.STALLED, self._cause(a.rank))
            for a in running
            if now - self.last[a.rank] > self.timeout_s
        ]

    def _cause(self, rank: int) -> str:
        # The limit, not the measured time: the same stall reads the same in every attempt.
        message = "stalled_silent" if rank in self.silent else "stalled"
        return words(message, timeout_s=self.timeout_s)
