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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from distributed.core import Status
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin
from distributed.protocol import pickle

from ddpflow.distributed.supervisor.failures import FailureKind
from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION, SupervisionConfig
from ddpflow.distributed.supervisor.wording import words

log = logging.getLogger(__name__)

# The Dask event topic of stops that no rank result can report (the worker was removed).
STOP_TOPIC = "ddpflow-graceful-stop"

_lock = threading.Lock()
_running = 0  # ranks running in this process
_idle = threading.Condition(_lock)
_reason: StopReason | None = None


@dataclass(frozen=True)
class StopReason:
    """Why a worker process's ranks were asked to stop: the kind the launcher acts on, and
    the words for people (a template of wording.MESSAGES and its details), told apart."""

    kind: FailureKind  # PREEMPTED (the worker leaves), GROW, or PEER_STOPPED
    message: str
    details: Mapping[str, str | int] = field(default_factory=dict)

    def __str__(self) -> str:
        return words(self.message, **self.details)

    def to_event(self) -> dict[str, Any]:
        """As a Dask event's payload (msgpack: plain values only)."""
        return {"kind": self.kind.value, "message": self.message, "details": dict(self.details)}

    @classmethod
    def from_event(cls, payload: Mapping[str, Any]) -> StopReason:
        return cls(FailureKind(payload["kind"]), payload["message"], payload.get("details", {}))


def leaving(address: str, how: str) -> StopReason:
    """The reason of worker `address` asked to leave; `how` is its words' template
    (stop_sigterm, stop_worker_closing, stop_nanny_closing)."""
    return StopReason(FailureKind.PREEMPTED, how, {"worker": address})


PEER_STOP = StopReason(FailureKind.PEER_STOPPED, "stop_peer")


class StopRequested(RuntimeError):
    """Raised by every rank after the checkpoint at the step the group agreed to stop:
    `reason` (what the launcher acts on), at `step` (1-based) of `epoch` (1-based), at the
    end of `epoch` (step None), or at `step` of a loop without epochs (epoch None)."""

    def __init__(self, reason: StopReason, epoch: int | None = None, step: int | None = None):
        super().__init__(reason, epoch, step)  # the args rebuild it when Dask unpickles it
        self.reason, self.epoch, self.step = reason, epoch, step

    def __str__(self) -> str:
        if self.epoch is None:
            return words("stopped_at_step", reason=self.reason, step=self.step)
        if self.step is None:
            return words("stopped_at_epoch_end", reason=self.reason, epoch=self.epoch)
        return words("stopped_in_epoch", reason=self.reason, epoch=self.epoch, step=self.step)


def request_stop(reason: StopReason) -> None:
    global _reason
    with _lock:
        _reason = _reason or reason


def stop_reason() -> StopReason | None:
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


def install(address: str, timings: SupervisionConfig = DEFAULT_SUPERVISION) -> bool:
    """Handle SIGTERM in this process (call from its main thread); False where that is
    impossible (a worker thread in another program's process). `timings`: its grace_s and
    result_delay_s."""

    def on_sigterm(signum: int, frame: Any) -> None:
        if stop_reason() is not None:
            return  # already on its way out
        request_stop(leaving(address, "stop_sigterm"))
        threading.Thread(
            target=_exit_when_idle, args=(timings,), name="ddpflow-graceful-stop", daemon=True
        ).start()

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: a threaded worker, nothing to install
        return False
    return True


def _exit_when_idle(timings: SupervisionConfig) -> None:
    grace_s = timings.grace_s
    deadline = time.monotonic() + grace_s
    with _lock:
        had_ranks = _running > 0
        while _running > 0 and time.monotonic() < deadline:
            _idle.wait(timeout=max(0.0, deadline - time.monotonic()))
        left = _running
    if left:
        log.warning("a rank still runs %.0f s after SIGTERM; the process exits anyway", grace_s)
    elif had_ranks:
        time.sleep(timings.result_delay_s)
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

    def __init__(self, timings: SupervisionConfig = DEFAULT_SUPERVISION):
        self.timings = timings

    def setup(self, worker: Any) -> None:
        if not install(worker.address, self.timings):
            log.info("SIGTERM handler not installed on %s (not the main thread)", worker.address)

    async def teardown(self, worker: Any) -> None:
        """Worker.close calls this after it has told the scheduler that it is closing and
        dropped its running tasks (their threads go on), before it shuts down its threads.
        `retire_workers` has removed the worker from the scheduler by then, so a rank's
        result would not arrive: the launcher learns of the stop from events on STOP_TOPIC."""
        if worker.status not in (Status.closing, Status.closing_gracefully):
            return  # replaced by a newer registration, not a close
        if not stop_if_running(leaving(worker.address, "stop_worker_closing")):
            return
        # The reason as data: the launcher acts on its kind (an earlier request, a grow's,
        # may be the one the ranks took).
        reason = stop_reason() or leaving(worker.address, "stop_worker_closing")
        notice = {"worker": worker.address, "state": "stopping", "why": reason.to_event()}
        worker.log_event(STOP_TOPIC, notice)
        left = await wait_until_idle(self.timings.grace_s, self.timings.stop_poll_s)
        worker.log_event(STOP_TOPIC, {"worker": worker.address, "state": "stopped", "left": left})


def stop_if_running(reason: StopReason) -> bool:
    """In a worker process: ask its ranks to stop; False (and no request) if none runs."""
    if running_ranks() == 0:
        return False
    request_stop(reason)
    return True


async def wait_until_idle(grace_s: float, poll_s: float) -> int:
    """Until no rank runs in this process, up to `grace_s`; returns how many still run."""
    deadline = time.monotonic() + grace_s
    while running_ranks() and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
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

    def __init__(self, timings: SupervisionConfig = DEFAULT_SUPERVISION):
        self.timings = timings

    async def teardown(self, nanny: Any) -> None:
        if nanny.status != Status.closing or not nanny.is_alive() or not nanny.worker_address:
            return  # a replaced registration, or a worker process that is gone already
        address, timings = nanny.worker_address, self.timings
        ask = timings.stop_ask_timeout_s
        try:
            reason = leaving(address, "stop_nanny_closing")
            if not await _in_worker(nanny, ask, stop_if_running, reason):
                return
            deadline = time.monotonic() + timings.grace_s
            while time.monotonic() < deadline and await _in_worker(nanny, ask, running_ranks):
                await asyncio.sleep(timings.stop_poll_s)
        except (OSError, TimeoutError, RuntimeError) as error:
            # Most often the worker process is going already (SIGTERM to the whole process
            # group): its own handler then makes the same stop.
            log.info("could not ask %s to stop its ranks before closing it: %s", address, error)
            return
        # The rank's StopRequested reaches the scheduler.
        await asyncio.sleep(timings.result_delay_s)


async def _in_worker(nanny: Any, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in the nanny's worker process, over the worker's `run` handler."""
    async with nanny.rpc(nanny.worker_address) as worker:
        answer = await asyncio.wait_for(
            worker.run(function=pickle.dumps(fn), args=pickle.dumps(args)), timeout_s
        )
    if answer.get("status") != "OK":
        raise RuntimeError(f"{fn.__name__}() failed in the worker: {answer.get('exception')}")
    return answer["result"]
