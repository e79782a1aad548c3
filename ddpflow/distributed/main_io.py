"""The other ranks wait for rank 0's IO (a checkpoint write) without timing out.

Rank 0 alone writes checkpoints; nobody may step on before the checkpoint exists, or a
restart would resume from an older one. A plain barrier after the write makes the others
wait inside a collective, where two clocks run against them: the collective's own timeout
(the group's `rank_timeout_s`) and the launcher's watchdog (no heartbeat for as long). A
store outage that rank 0 waits out (DDPFLOW_STORE_OUTAGE_S, 5 minutes by default) would
fail the group after `rank_timeout_s` (2 minutes by default) however long the outage bound.

So the others wait outside any collective: they poll the group's key-value store (the
TCPStore its ranks met through) for rank 0's word, beating as they go, and only then meet in
a barrier that completes at once. Rank 0 writes "ok" when its IO is done and "failed" when it
raised, so the others fail at once with the cause named instead of waiting out the bound. If
rank 0's process dies, the store (served from it) goes with it and their next poll fails.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: the flow process imports this package
    import torch.distributed as dist

OK = b"ok"
FAILED = b"failed"
# Polls start fast (a checkpoint write of a small model takes milliseconds) and back off.
FIRST_POLL_S = 0.002
MAX_POLL_S = 0.5


class MainRankFailed(RuntimeError):
    """Raised on the other ranks when rank 0's IO raised (its own error names the cause)."""


@dataclass
class MainIO:
    """What a group's ranks share to wait for rank 0: its store and a call counter.

    Every rank enters `rank0_io` at the same points in the same order, so the n-th call on
    each rank names the same key. A group is new for every launch, so keys never repeat.
    """

    store: dist.Store
    bound_s: float  # the longest the others wait for rank 0's word
    _calls: Iterator[int] = field(default_factory=itertools.count)

    def next_key(self, what: str) -> str:
        return f"ddpflow/main-io/{next(self._calls)}/{what}"


@contextmanager
def rank0_io(
    io: MainIO | None,
    rank: int,
    world_size: int,
    what: str,
    heartbeat: Callable[[], None],
) -> Iterator[None]:
    """Around rank 0's IO, entered on EVERY rank: no rank leaves before rank 0's IO is done.

    `io` None (a group without a store, e.g. one a test set up itself) falls back to a plain
    barrier. `what` names the IO in errors ("checkpoint").
    """
    if world_size < 2:
        yield
        return
    import torch.distributed as dist

    if io is None:
        yield
        dist.barrier()
        return
    key = io.next_key(what)
    if rank == 0:
        try:
            yield
        except BaseException:
            _say(io, key, FAILED)
            raise
        _say(io, key, OK)
    else:
        yield
        _wait_for_word(io, key, what, heartbeat)
    dist.barrier()  # everyone is here now; this only orders the collectives that follow


def _say(io: MainIO, key: str, word: bytes) -> None:
    with contextlib.suppress(RuntimeError):  # the store is gone: the others' polls fail
        io.store.set(key, word)  # type: ignore[arg-type]  # torch's stub says str; bytes work


def _wait_for_word(io: MainIO, key: str, what: str, heartbeat: Callable[[], None]) -> None:
    deadline = time.monotonic() + io.bound_s
    pause = FIRST_POLL_S
    while not io.store.check([key]):  # raises if rank 0's process (the store) is gone
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0's {what} did not finish within {io.bound_s:.0f} s; the other ranks "
                "stop waiting (raise DDPFLOW_STORE_OUTAGE_S or rank_timeout_s to wait longer)"
            )
        heartbeat()  # waiting for rank 0 is not a hang: the watchdog must not fail this rank
        time.sleep(pause)
        pause = min(MAX_POLL_S, pause * 2)
    if io.store.get(key) == FAILED:
        raise MainRankFailed(f"rank 0 failed during its {what}; its error names the cause")
