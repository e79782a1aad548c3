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
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

# Far longer than the event loop needs to run one callback; a loop blocked that long has
# bigger problems, and the export then runs unprotected (registration's fallback catches it).
PAUSE_TIMEOUT_S = 10.0


@contextmanager
def worker_profiler_paused() -> Iterator[bool]:
    """Stop the current Dask worker's profiler for the block; yields whether one was
    stopped. Outside a Dask worker, or with its profiler off, it does nothing."""
    try:
        from distributed import get_worker
        from distributed.utils import sync

        worker = get_worker()
    except (ImportError, ValueError):  # not in a Dask worker's task
        yield False
        return
    profiler = worker.periodic_callbacks.get("profile")
    if profiler is None or not profiler.is_running():
        yield False
        return

    # A PeriodicCallback belongs to its event loop: stop and start it there.
    async def stop() -> None:
        profiler.stop()

    async def start() -> None:
        if not profiler.is_running():
            profiler.start()

    sync(worker.loop, stop, callback_timeout=PAUSE_TIMEOUT_S)
    try:
        yield True
    finally:
        try:
            sync(worker.loop, start, callback_timeout=PAUSE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a closing worker's loop; the work is done
            log.warning("Dask's profiler was not restarted on this worker: %s", error)
