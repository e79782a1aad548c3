"""Growing a running group: workers that joined the cluster and stayed make it larger.

While a group trains, a `GrowWatch` thread in the launching process looks at the cluster's
workers every `grow_poll_s` (ddpflow.distributed.supervisor.timings). A worker that was not
in the group is a candidate once it has been there for `settle_s` without a break: one that
joins and leaves inside that time (a node that fails its start, a spot instance taken back
at once) causes nothing. When the group plus its settled candidates is larger than the group
(up to `max_workers`), the watch asks the group's ranks to stop, exactly as a worker that is
asked to leave does (graceful_stop): fit() takes a step checkpoint at its next control step
and every rank raises StopRequested, whose reason is of the kind GROW. The launcher
(relaunch.py) then relaunches the group at the new size, which resumes from that checkpoint.
That relaunch is not a failure and spends no restart (policy.py).

A rank function that never reaches a control step (its own loop, not ddpflow.fit) is never
stopped: it finishes at the size it started with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import distributed

from ddpflow.distributed.planning import workers_with_resources
from ddpflow.distributed.supervisor import graceful_stop
from ddpflow.distributed.supervisor.failures import FailureKind
from ddpflow.distributed.supervisor.graceful_stop import StopReason
from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION, SupervisionConfig
from ddpflow.distributed.supervisor.watch import cluster_workers

log = logging.getLogger(__name__)


@dataclass
class JoinTracker:
    """Which workers outside the group have stayed `settle_s` (pure bookkeeping: the watch
    feeds it the cluster's workers and the time)."""

    settle_s: float
    first_seen: dict[str, float] = field(default_factory=dict)

    def settled(self, group: Sequence[str], present: Sequence[str], now: float) -> list[str]:
        """The workers of `present`, not in `group`, seen at every look for `settle_s`."""
        outside = set(present) - set(group)
        # A worker that left is forgotten: if it comes back, its settle time starts again.
        self.first_seen = {w: t for w, t in self.first_seen.items() if w in outside}
        for worker in outside:
            self.first_seen.setdefault(worker, now)
        return sorted(w for w, t in self.first_seen.items() if now - t >= self.settle_s)


def grow_target(group_size: int, settled: int, max_workers: int) -> int | None:
    """The larger world size to relaunch at, or None to go on as is."""
    target = min(max_workers, group_size + settled)
    return target if target > group_size else None


def ask_running_ranks_to_grow(reason: StopReason) -> bool:
    """In a worker process: ask the ranks running there to stop for a grow (False: none
    runs). The reason stays until `forget_grow` clears it."""
    if graceful_stop.running_ranks() == 0:
        return False
    graceful_stop.request_stop(reason)
    return True


def forget_grow() -> bool:
    """In a worker process: drop a grow's stop request, so the next group's ranks here run;
    a leaving worker's own request (SIGTERM, a close) stays."""
    reason = graceful_stop.stop_reason()
    if reason is None or reason.kind is not FailureKind.GROW:
        return False
    graceful_stop.clear()
    return True


class GrowWatch:
    """A thread that asks the group to stop once settled workers would make it larger."""

    def __init__(
        self,
        client: distributed.Client,
        max_workers: int,
        settle_s: float,
        resources: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        timings: SupervisionConfig = DEFAULT_SUPERVISION,
    ):
        self.client, self.max_workers, self.resources = client, max_workers, resources
        self.timings = timings
        self.tracker = JoinTracker(settle_s)
        self.clock = clock
        self.group: list[str] = []
        self.joined: list[str] = []  # the settled workers that made the group grow
        self.target: int | None = None  # set once the group was asked to stop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, group: Sequence[str]) -> None:
        """Called by the launcher with the workers of the group it has just planned."""
        self.group = list(group)
        if len(self.group) >= self.max_workers:
            return  # as large as allowed already
        self._thread = threading.Thread(target=self._run, name="ddpflow-grow-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching, and drop a grow request the ranks did not take (the group finished
        or failed first): their worker processes will run the next group's ranks."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timings.grow_poll_s * 5)
        if self.target is not None:
            try:
                self.client.run(forget_grow, workers=self.group, on_error="ignore")
            except Exception as error:  # noqa: BLE001 - a gone worker has nothing to forget
                log.info("could not clear the grow request on %s: %s", self.group, error)

    def usable(self) -> list[str]:
        workers: Mapping[str, Mapping[str, Any]]
        workers = cluster_workers(self.client, self.timings.scheduler_timeout_s)
        if self.resources:
            workers = workers_with_resources(workers, self.resources, world_size=0)
        return sorted(workers)

    def _run(self) -> None:
        while not self._stop.wait(self.timings.grow_poll_s):
            try:
                settled = self.tracker.settled(self.group, self.usable(), self.clock())
            except Exception as error:  # noqa: BLE001 - the scheduler may be busy: look again
                log.info("the grow watch could not list the workers: %s", error)
                continue
            target = grow_target(len(self.group), len(settled), self.max_workers)
            if target is None:
                continue
            self.joined, self.target = settled, target
            details: dict[str, str | int] = {
                "old": len(self.group),
                "new": target,
                "joined": ", ".join(settled),
            }
            reason = StopReason(FailureKind.GROW, "stop_grow", details)
            log.info("%s; asking the group to checkpoint and stop", reason)
            try:
                self.client.run(
                    ask_running_ranks_to_grow, reason, workers=self.group, on_error="ignore"
                )
            except Exception as error:  # noqa: BLE001 - the group ends by itself then
                log.warning("could not ask the group to stop for a grow: %s", error)
            return
