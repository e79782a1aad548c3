"""Workers that leave on request stop their group first; the launcher waits for that stop.

`retire_workers` removes a worker from the scheduler at once (a rank holds no data to move
away), and only then does the worker close. Its rank's task is dropped with it, so the rank's
StopRequested never arrives as a result: the launcher would see "its worker left the
cluster" and relaunch while the group is still on its way to the checkpoint. Instead, the
worker's GracefulStop teardown (ddpflow.distributed.graceful_stop) posts Dask events on STOP_TOPIC:
"stopping" when it asks its ranks to stop, "stopped" once none runs. A worker that left and
posted "stopping" is waited for: until the group's other ranks have returned (they stop at
the same step) and the leaver has posted "stopped", at most the grace period.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import distributed

from ddpflow.distributed.graceful_stop import DEFAULT_GRACE_S, RESULT_DELAY_S, STOP_TOPIC

EVENTS_S = 30.0  # the scheduler answers in milliseconds unless it is gone
# A worker the scheduler removed on request posts "stopping" within milliseconds (measured:
# 10 ms after retire_workers); a worker that was killed never does.
NOTICE_S = 3.0
POLL_S = 0.1
# Event times are the scheduler's clock: a little slack for another host's.
CLOCK_SLACK_S = 30.0


def stopping_workers(
    client: distributed.Client, addresses: Iterable[str], since: float, notice_s: float = NOTICE_S
) -> dict[str, str]:
    """Of `addresses` (workers that left), those that stop their ranks before closing, with
    the stop's reason. Waits up to `notice_s` for the notice of a worker that the scheduler
    removed on request (its event log says so); a worker that died is not waited for."""
    wanted = set(addresses)
    deadline = time.monotonic() + notice_s
    on_request: set[str] | None = None
    while True:
        found = {
            m["worker"]: str(m.get("why"))
            for m in _events(client, STOP_TOPIC, since)
            if m.get("state") == "stopping" and m.get("worker") in wanted
        }
        if on_request is None:
            on_request = {a for a in wanted - set(found) if _removed_on_request(client, a, since)}
        if not on_request - set(found) or time.monotonic() >= deadline:
            return found
        time.sleep(POLL_S)


def wait_for_group_stop(
    client: distributed.Client,
    futures: Sequence[distributed.Future],
    present: Sequence[bool],
    leavers: Iterable[str],
    since: float,
    timeout_s: float = DEFAULT_GRACE_S + RESULT_DELAY_S + 5,
) -> None:
    """Until every rank whose worker is still there has returned and every leaver has said
    its ranks are done (or `timeout_s`): a relaunch before that would race the checkpoint."""
    waiting = set(leavers)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = [f for f, here in zip(futures, present, strict=True) if here and not f.done()]
        if waiting:
            events = _events(client, STOP_TOPIC, since)
            waiting -= {m.get("worker") for m in events if m.get("state") == "stopped"}
        if not running and not waiting:
            return
        time.sleep(POLL_S)


def left_cause(address: str, stopping: dict[str, str], otherwise: str) -> str:
    if address in stopping:
        return f"{stopping[address]}; it stopped its rank and left the cluster"
    return otherwise


def _removed_on_request(client: distributed.Client, address: str, since: float) -> bool:
    """The scheduler removed the worker as expected (retired, closed by its nanny), not
    because its connection broke."""
    return any(
        m.get("action") == "remove-worker" and m.get("expected")
        for m in _events(client, address, since)
    )


def _events(client: distributed.Client, topic: str, since: float) -> list[dict[str, Any]]:
    # client.get_events() would wait for the scheduler without a bound.
    events = client.sync(client.scheduler.events, topic=topic, callback_timeout=EVENTS_S)
    return [m for t, m in events if isinstance(m, dict) and t >= since - CLOCK_SLACK_S]
