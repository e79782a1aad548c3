"""Workers that leave on request stop their group first; the launcher waits for that stop.

`retire_workers` removes a worker from the scheduler at once (a rank holds no data to move
away), and only then does the worker close. Its rank's task is dropped with it, so the rank's
StopRequested never arrives as a result: the launcher would see "its worker left the
cluster" and relaunch while the group is still on its way to the checkpoint. Instead, the
worker's GracefulStop teardown (graceful_stop.py) posts Dask events on STOP_TOPIC: "stopping",
with the stop's reason, when it asks its ranks to stop, "stopped" once none runs. A worker
that left and posted "stopping" is waited for: until the group's other ranks have returned
(they stop at the same step) and the leaver has posted "stopped", at most the grace period.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import distributed

from ddpflow.distributed.supervisor.failures import FailureKind, RankFailure
from ddpflow.distributed.supervisor.graceful_stop import STOP_TOPIC, StopReason
from ddpflow.distributed.supervisor.timings import SupervisionConfig
from ddpflow.distributed.supervisor.wording import words


def stopping_workers(
    client: distributed.Client,
    addresses: Iterable[str],
    since: float,
    timings: SupervisionConfig,
    wait: bool = True,
) -> dict[str, StopReason]:
    """Of `addresses` (workers that left), those that stop their ranks before closing, with
    the stop's reason. With `wait`, waits up to timings.notice_s for the notice of a worker
    that the scheduler removed on request (its event log says so); a worker that died is
    not waited for."""
    wanted = set(addresses)
    deadline = time.monotonic() + (timings.notice_s if wait else 0.0)
    on_request: set[str] | None = None
    while True:
        found = {
            m["worker"]: StopReason.from_event(m["why"])
            for m in _events(client, STOP_TOPIC, since, timings)
            if m.get("state") == "stopping"
            and m.get("worker") in wanted
            and isinstance(m.get("why"), dict)
        }
        if on_request is None:
            on_request = {
                a for a in wanted - set(found) if _removed_on_request(client, a, since, timings)
            }
        if not on_request - set(found) or time.monotonic() >= deadline:
            return found
        time.sleep(timings.notice_poll_s)


def wait_for_group_stop(
    client: distributed.Client,
    futures: Sequence[distributed.Future],
    present: Sequence[bool],
    leavers: Iterable[str],
    since: float,
    timings: SupervisionConfig,
) -> None:
    """Until every rank whose worker is still there has returned and every leaver has said
    its ranks are done (or timings.leave_wait_s): a relaunch before that would race the
    checkpoint."""
    waiting = set(leavers)
    deadline = time.monotonic() + timings.leave_wait_s
    while time.monotonic() < deadline:
        running = [f for f, here in zip(futures, present, strict=True) if here and not f.done()]
        if waiting:
            events = _events(client, STOP_TOPIC, since, timings)
            waiting -= {m.get("worker") for m in events if m.get("state") == "stopped"}
        if not running and not waiting:
            return
        time.sleep(timings.notice_poll_s)


def left_failure(rank: int, address: str, stopping: dict[str, StopReason]) -> RankFailure:
    """Rank `rank`'s failure, its worker gone: of its stop's kind where the worker stopped it
    first (`stopping`), else a lost worker."""
    reason = stopping.get(address)
    if reason is None:
        return RankFailure(rank, address, FailureKind.WORKER_LOST, words("worker_left"))
    return RankFailure(rank, address, reason.kind, words("left_after_stop", reason=reason))


def _removed_on_request(
    client: distributed.Client, address: str, since: float, timings: SupervisionConfig
) -> bool:
    """The scheduler removed the worker as expected (retired, closed by its nanny), not
    because its connection broke."""
    return any(
        m.get("action") == "remove-worker" and m.get("expected")
        for m in _events(client, address, since, timings)
    )


def _events(
    client: distributed.Client, topic: str, since: float, timings: SupervisionConfig
) -> list[dict[str, Any]]:
    # client.get_events() would wait for the scheduler without a bound.
    assert client.scheduler is not None  # a connected client has its scheduler's handle
    events = client.sync(
        client.scheduler.events, topic=topic, callback_timeout=timings.scheduler_timeout_s
    )
    return [m for t, m in events if isinstance(m, dict) and t >= since - timings.clock_slack_s]
