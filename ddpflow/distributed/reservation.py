"""Cluster-wide worker reservations, so DDP groups of different flow runs never interleave.

Two runs sharing one Dask cluster (two deployment runs, a sweep next to a training) would
otherwise pin ranks to the same workers: the second group's ranks queue behind the first
group's, never start, and fail at the rank timeout. Each launch instead takes one Dask lock
per worker it uses (held on the scheduler, released when the group ends or its client
dies) and a launch that finds too few free workers waits its turn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import distributed

log = logging.getLogger(__name__)


class ReservationTimeout(TimeoutError):
    """Not enough workers became free in time."""


def _lock(client: distributed.Client, worker: str) -> distributed.Lock:
    # Lock() would look for a default client; Prefect's client deliberately is not one.
    return distributed.Lock(
        f"ddpflow-worker-{worker}", scheduler_rpc=client.scheduler, loop=client.loop
    )


@contextmanager
def reserve_workers(
    client: distributed.Client,
    candidates: Sequence[str],
    count: int,
    wait_s: float = 3600.0,
    poll_s: float = 1.0,
) -> Iterator[list[str]]:
    """Hold `count` of `candidates` (address order) for the duration of the block."""
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        held = _try_acquire(client, sorted(candidates), count)
        if len(held) == count:
            break
        _release(held)
        if time.monotonic() >= deadline:
            raise ReservationTimeout(
                f"{count} of the workers {sorted(candidates)} were not free within {wait_s:g}s "
                "(other DDP groups hold them)"
            )
        if not announced:
            log.warning("waiting for %d free workers: other DDP groups are using them", count)
            announced = True
        time.sleep(poll_s)
    try:
        yield [worker for worker, _ in held]
    finally:
        _release(held)


def _try_acquire(
    client: distributed.Client, candidates: list[str], count: int
) -> list[tuple[str, distributed.Lock]]:
    held = []
    for worker in candidates:
        lock = _lock(client, worker)
        if lock.acquire(blocking=False):
            held.append((worker, lock))
            if len(held) == count:
                break
    return held


def _release(held: list[tuple[str, distributed.Lock]]) -> None:
    for _, lock in held:
        try:
            lock.release()
        except Exception:  # noqa: BLE001 - a lease that already expired needs no release
            log.debug("lock already released", exc_info=True)
