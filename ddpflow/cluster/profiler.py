"""Dask's worker profiler, paused while torch.export traces in the worker.

The profiler (on by default in a plain `dask worker`; ddpflow's own workers run without it)
runs on the worker's event loop thread: every 10 ms it takes the frames of every thread
(`sys._current_frames()`), walks those of the threads running tasks, and drops them. A
frame object taken from a running function keeps that function's locals alive after it
returns, until the profiler drops it, so the last Python reference to a tensor can be
released on the event loop thread while the task's thread is inside torch's dispatch.
When torch.export is tracing, torch then gives the traced code a new alias of that tensor
which its tracer never recorded, and the export fails ("We found a fake tensor in the
exported program constant's list"). Pausing the profiler for the export removes the only
thread of a Dask worker that takes other threads' frames.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)
# Far longer than the event loop needs to run one callback; a loop blocked that long has
# bigger problems, and the export then runs unprotected (registration's fallback catches it).
PAUSE_TIMEOUT_S = 10.0


class _Pauses:
    """The pauses held in this process: a worker with several threads may export in two at
    once, and the profiler must stay stopped until the last of them ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.stopped = False  # by the first pause; only then does the last one restart it


_pauses = _Pauses()


def _current_worker() -> Any:
    """The Dask worker whose task this thread runs, or None."""
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):  # not in a Dask worker's task
        return None


@contextmanager
def worker_profiler_paused() -> Iterator[bool]:
    """Keep the current Dask worker's profiler stopped for the block; yields whether it is.
    Outside a Dask worker, or with its profiler off, it does nothing."""
    worker = _current_worker()
    profiler = worker.periodic_callbacks.get("profile") if worker is not None else None
    if profiler is None:
        yield False
        return
    from distributed.utils import sync

    # A PeriodicCallback belongs to its event loop: stop and start it there.
    async def stop() -> None:
        profiler.stop()

    async def start() -> None:
        profiler.start()

    with _pauses.lock:
        if _pauses.held == 0 and profiler.is_running():
            try:
                sync(worker.loop, stop, callback_timeout=PAUSE_TIMEOUT_S)
                _pauses.stopped = True
            except Exception as error:  # noqa: BLE001 - the export runs all the same
                log.warning("Dask's profiler could not be paused on this worker: %s", error)
        _pauses.held += 1
        paused = _pauses.stopped
    try:
        yield paused
    finally:
        with _pauses.lock:
            _pauses.held -= 1
            if _pauses.held == 0 and _pauses.stopped:
                _pauses.stopped = False
                try:
                    sync(worker.loop, start, callback_timeout=PAUSE_TIMEOUT_S)
                except Exception as error:  # noqa: BLE001 - a closing worker's loop
                    log.warning("Dask's profiler was not restarted on this worker: %s", error)
