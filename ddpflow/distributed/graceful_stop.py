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

A worker can also be asked to leave without a signal in its process: `retire_workers`, and
SIGTERM to its nanny (what `dask worker` and a Kubernetes pod get), close it through
`Worker.close` and `Nanny.close`, and the process goes without a signal. The plugins' teardowns
run early in both (the nanny's before it asks its worker process to close) and make the same
stop: they ask the ranks in the worker process to stop and wait for them, up to `grace_s`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from distributed.core import Status
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin
from distributed.protocol import pickle

log = logging.getLogger(__name__)

# Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds both default to 30 s, after
# which SIGKILL follows: exit a little before that, checkpoint or not.
DEFAULT_GRACE_S = 25.0
# After the rank returned, let its result (StopRequested) reach the scheduler before the
# process goes: the launcher then names the stop as the cause, not a lost worker.
RESULT_DELAY_S = 1.0

# In the StopRequested message of the rank whose worker was asked to leave: the launcher waits
# for that worker to leave before it relaunches (ddpflow.distributed.elastic). Every such
# cause contains STOP_CAUSE; the peers' "was asked to stop;" does not.
STOP_CAUSE = "asked to stop ("
SIGTERM_CAUSE = f"{STOP_CAUSE}SIGTERM)"
WORKER_CLOSING_CAUSE = f"{STOP_CAUSE}its worker is closing: retire_workers or its nanny)"
NANNY_CLOSING_CAUSE = f"{STOP_CAUSE}its nanny is closing: SIGTERM to dask worker or a shutdown)"
# The stop reason of a rank that was not asked itself: its group agreed on a peer's request.
PEER_STOP_CAUSE = "another worker of the group was asked to stop"
# The Dask event topic of stops that no rank result can report (the worker was removed).
STOP_TOPIC = "ddpflow-graceful-stop"
POLL_S = 0.1
ASK_TIMEOUT_S = 10.0  # a worker process answers in milliseconds unless it is wedged

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


def running_ranks() -> int:
    return _running


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
    """A Dask worker plugin that installs the SIGTERM handler in each worker process, and
    stops the ranks there before the worker closes (`retire_workers`, its nanny closing).

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

    async def teardown(self, worker: Any) -> None:
        """Worker.close calls this after it has told the scheduler that it is closing and
        dropped its running tasks (their threads go on), before it shuts down its threads.
        `retire_workers` has removed the worker from the scheduler by then, so a rank's
        result would not arrive: the launcher learns of the stop from events on STOP_TOPIC."""
        if worker.status not in (Status.closing, Status.closing_gracefully):
            return  # replaced by a newer registration, not a close
        if not stop_if_running(worker.address, WORKER_CLOSING_CAUSE):
            return
        reason = stop_reason()
        worker.log_event(STOP_TOPIC, {"worker": worker.address, "state": "stopping", "why": reason})
        left = await wait_until_idle(self.grace_s)
        worker.log_event(STOP_TOPIC, {"worker": worker.address, "state": "stopped", "left": left})


def stop_if_running(address: str, cause: str) -> bool:
    """In a worker process: ask its ranks to stop; False (and no request) if none runs."""
    if running_ranks() == 0:
        return False
    request_stop(f"worker {address} {cause}")
    return True


async def wait_until_idle(grace_s: float) -> int:
    """Until no rank runs in this process, up to `grace_s`; returns how many still run."""
    deadline = time.monotonic() + grace_s
    while running_ranks() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    if running_ranks():
        log.warning("a rank still runs %.0f s after the stop request; closing anyway", grace_s)
    return running_ranks()


class GracefulNannyStop(NannyPlugin):
    """Stops the ranks of a nanny's worker process before the nanny closes it.

    `Nanny.close` (SIGTERM to `dask worker`, a pod's SIGTERM, a cluster shutting down) tears
    its plugins down first and only then asks its worker process to close, which it kills
    after 0.8 of the close timeout (8 s for `dask worker`): too short for a checkpoint at the
    next control step, and too late for the rank's result, which Worker.close drops. Here
    the worker process still runs normally: the ranks stop with StopRequested, whose cause
    names the worker, the result reaches the scheduler, and then the close goes on.
    """

    name = "ddpflow-graceful-nanny-stop"
    idempotent = True

    def __init__(self, grace_s: float = DEFAULT_GRACE_S):
        self.grace_s = grace_s

    async def teardown(self, nanny: Any) -> None:
        if nanny.status != Status.closing or not nanny.is_alive() or not nanny.worker_address:
            return  # a replaced registration, or a worker process that is gone already
        address = nanny.worker_address
        try:
            if not await _in_worker(nanny, stop_if_running, address, NANNY_CLOSING_CAUSE):
                return
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and await _in_worker(nanny, running_ranks):
                await asyncio.sleep(POLL_S)
        except (OSError, TimeoutError, RuntimeError) as error:
            # Most often the worker process is going already (SIGTERM to the whole process
            # group): its own handler then makes the same stop.
            log.info("could not ask %s to stop its ranks before closing it: %s", address, error)
            return
        await asyncio.sleep(RESULT_DELAY_S)  # the rank's StopRequested reaches the scheduler


async def _in_worker(nanny: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in the nanny's worker process, over the worker's `run` handler."""
    async with nanny.rpc(nanny.worker_address) as worker:
        answer = await asyncio.wait_for(
            worker.run(function=pickle.dumps(fn), args=pickle.dumps(args)), ASK_TIMEOUT_S
        )
    if answer.get("status") != "OK":
        raise RuntimeError(f"{fn.__name__}() failed in the worker: {answer.get('exception')}")
    return answer["result"]
