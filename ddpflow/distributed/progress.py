"""Progress lines from a rank group to the process that launched it.

Rank 0 sends them with RankContext.report() as Dask events on the group's topic; the
launcher follows the topic while the group runs and hands each line to its caller.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import distributed

log = logging.getLogger(__name__)
EVENTS_S = 30.0  # the scheduler answers in milliseconds unless it is gone


@contextlib.contextmanager
def follow_progress(
    client: distributed.Client, topic: str, on_progress: Callable[[str], None] | None
) -> Iterator[None]:
    """Pass the group's progress events to `on_progress` while it runs, then any that had
    not arrived yet (events reach subscribers asynchronously; the scheduler keeps them)."""
    if on_progress is None:
        yield
        return
    seen: set[tuple[float, str]] = set()

    def deliver(event: tuple[float, Any]) -> None:
        key = (event[0], str(event[1]))
        if key in seen:
            return
        seen.add(key)
        try:
            on_progress(key[1])
        except Exception as error:  # noqa: BLE001 - runs on the client's event loop
            log.debug("progress handler failed: %s", error)

    # An event sent before the subscription reaches the scheduler is delivered at the end.
    client.subscribe_topic(topic, deliver)
    try:
        yield
    finally:
        client.unsubscribe_topic(topic)
        try:
            # client.get_events() would wait for the scheduler without a bound.
            events = client.sync(client.scheduler.events, topic=topic, callback_timeout=EVENTS_S)
            for event in events:
                deliver(event)
        except Exception as error:  # noqa: BLE001 - progress must never fail the launch
            log.debug("could not fetch the last progress events of %s: %s", topic, error)
