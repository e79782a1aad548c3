"""A worker asked to leave (SIGTERM from Slurm, Kubernetes or a person) checkpoints first.

Without this, SIGTERM ends a Dask worker process at once (the nanny's worker process
installs no handler), exactly like a kill: the run resumes from its last checkpoint. With
the `GracefulStop` worker plugin, SIGTERM in a worker process that runs a rank only asks the
training to stop. fit() reads the request at its next control point (every
`log_every_steps` steps), the group agrees on it with the checkpoint trigger's all-reduce,
rank 0 writes a checkpoint at that step, and every rank raises `StopRequested`. The
launcher then relaunches the group as after any failure, and the run goes on from that step.

The process still goes away, as the sender expects: once no rank runs in it any more (or
after `grace_s`, whichever comes first), it exits with SIGTERM's status. A worker process
that runs no rank exits at once, as before. The nanny (a LocalCluster's or `dask worker`'s)
then starts a fresh worker process, as after a crash.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

log = logging.getLogger(__name__)

# Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds both default to 30 s, after
# which SIGKILL follows: exit a little before that, checkpoint or not.
DEFAULT_GRACE_S = 25.0
# After the rank returned, let its result (StopRequested) reach the scheduler before the
# process goes: the launcher then names the stop as the cause, not a lost worker.
RESULT_DELAY_S = 1.0

# In the StopRequested message of the rank whose worker was sent SIGTERM: the launcher waits
# for that worker to leave before it relaunches (ddpflow.distributed.elastic).
SIGTERM_CAUSE = "asked to stop (SIGTERM)"

_lock = threading.Lock()
_running = 0  # ranks running in this process
_idle = threading.Condition(_lock)
_reason: str | None = None


class StopRequested(RuntimeError):
    """Raised by every rank after the checkpoint at the step the group agreed to stop."""


def request_stop(reason: str) -> None:
    global _reason
    with _lock:
        _reason = _reason or reason


def stop_reason() -> str | None:
    """Why this process was asked to stop, or None. Read by fit() at control points."""
    return _reason


def clear() -> None:
    """Forget a request (tests, and a process that was asked but kept running)."""
    global _reason
    with _lock:
        _reason = None


@contextmanager
def rank_running() -> Iterator[None]:
    """Around a rank's work in a worker process: the process exits only when none runs."""
    global _running
    with _lock:
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            _idle.notify_all()


def install(address: str, grace_s: float = DEFAULT_GRACE_S) -> bool:
    """Handle SIGTERM in this process (call from its main thread); False where that is
    impossible (a worker thread in another program's process)."""

    def on_sigterm(signum: int, frame: Any) -> None:
        if stop_reason() is not None:
            return  # already on its way out
        request_stop(f"worker {address} {SIGTERM_CAUSE}")
        threading.Thread(
            target=_exit_when_idle, args=(grace_s,), name="ddpflow-graceful-stop", daemon=True
        ).start()

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: a threaded worker, nothing to install
        return False
    return True


def _exit_when_idle(grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    with _lock:
        had_ranks = _running > 0
        while _running > 0 and time.monotonic() < deadline:
            _idle.wait(timeout=max(0.0, deadline - time.monotonic()))
        left = _running
    if left:
        log.warning("a rank still runs %.0f s after SIGTERM; the process exits anyway", grace_s)
    elif had_ranks:
        time.sleep(RESULT_DELAY_S)
    # The exit status of a process ended by SIGTERM. (Re-raising the signal would need the
    # default handler back, which only the main thread may set.)
    os._exit(128 + signal.SIGTERM)


class GracefulStop(WorkerPlugin):
    """A Dask worker plugin that installs the SIGTERM handler in each worker process.

    Its setup runs on the worker's event loop, which is the main thread of a nanny's worker
    process: the only thread that may set a signal handler. Registered by the launcher, so
    a worker that a nanny restarts later gets it too.
    """

    name = "ddpflow-graceful-stop"
    idempotent = True

    def __init__(self, grace_s: float = DEFAULT_GRACE_S):
        self.grace_s = grace_s

    def setup(self, worker: Any) -> None:
        if not install(worker.address, self.grace_s):
            log.info("SIGTERM handler not installed on %s (not the main thread)", worker.address)

    def teardown(self, worker: Any) -> None:
        pass
