"""Progress from a rank group to the process that launched it: one event type, one channel.

A rank sends `Progress` events (RankContext.send, .report) as Dask events on its launch's
topic; the launcher follows that topic once while the group runs, fetches what had not
arrived when it ends, and hands each event to every subscriber in order: the log-line
callback (`line_subscriber`, ddpflow.run's on_progress) and, in a Prefect task, the progress
artifact (ddpflow.integrations.prefect.progress_artifact). A subscriber that lives longer
than one launch (the artifact, across the restarts of a group) is handed to each of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import distributed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """One progress event: a line for the log, a training's step counts, or both.

    `line` is None for a step update that is not worth a log line; the step fields are None
    for a line that is not about steps (a rank naming its worker, a resume).
    """

    line: str | None = None
    step: int | None = None  # global optimizer steps done, counted over all epochs
    total_steps: int | None = None
    epoch: int | None = None  # the epoch under way (1-based)
    epochs: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None  # set once an epoch's validation is done

    def __post_init__(self) -> None:
        """Plain numbers, so the event always travels (Dask sends it as msgpack, which takes
        no tensor or numpy scalar): a value that is no number fails here, at the sender's
        call, naming the field, not later inside Dask."""
        for name, kind in _NUMBERS.items():
            value = getattr(self, name)
            if value is None:
                continue
            try:
                object.__setattr__(self, name, kind(value))
            except (TypeError, ValueError):
                raise TypeError(
                    f"Progress({name}={value!r}): {name} must be a number or None"
                ) from None
        if self.line is not None and not isinstance(self.line, str):
            raise TypeError(f"Progress(line={self.line!r}): line must be a str or None")

    @property
    def has_steps(self) -> bool:
        return self.step is not None and self.total_steps is not None

    @property
    def steps_done(self) -> int:
        return self.step or 0

    @property
    def percent(self) -> float:
        """The share of all steps done, 0 for an event without steps."""
        if not self.total_steps:
            return 0.0
        return 100.0 * min(1.0, self.steps_done / self.total_steps)

    def describe(self) -> str:
        """The step counts and losses in words (empty for an event without steps)."""
        if not self.has_steps:
            return ""
        text = (
            f"epoch {self.epoch}/{self.epochs}, step {self.step}/{self.total_steps} "
            f"({self.percent:.0f} %)"
        )
        if self.train_loss is not None:
            text += f", train loss {self.train_loss:.4f}"
        return text + (f", val loss {self.val_loss:.4f}" if self.val_loss is not None else "")

    def to_event(self) -> dict[str, Any]:
        """The Dask event's payload: a dict, since Dask sends events as msgpack."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_event(cls, payload: Any) -> Progress | None:
        """The progress in a Dask event's payload; None for anything else.

        Dask adds the sender's address ("worker") to a dict it delivers: extra keys are
        ignored.
        """
        if not isinstance(payload, dict):
            return None
        try:
            return cls(**{k: payload[k] for k in cls.__dataclass_fields__ if k in payload})
        except TypeError:
            return None


_NUMBERS: dict[str, type] = {
    "step": int,
    "total_steps": int,
    "epoch": int,
    "epochs": int,
    "train_loss": float,
    "val_loss": float,
}
Subscriber = Callable[[Progress], None]


def progress_topic(launch_id: str) -> str:
    """The one Dask event topic a launch's ranks send their progress on."""
    return f"ddpflow-progress-{launch_id}"


def send_progress(topic: str | None, progress: Progress) -> None:
    """Post `progress` on `topic` from this rank's worker: a local call that queues the event
    for the scheduler, so it never blocks or fails a step."""
    if topic is None:
        return
    with contextlib.suppress(ValueError, RuntimeError):  # not in a Dask worker: nobody listens
        distributed.get_worker().log_event(topic, progress.to_event())


def line_subscriber(on_line: Callable[[str], None]) -> Subscriber:
    """A subscriber that passes each event's line, if it has one, to `on_line`."""

    def deliver(progress: Progress) -> None:
        if progress.line is not None:
            on_line(progress.line)

    return deliver


@contextlib.contextmanager
def follow_progress(
    client: distributed.Client,
    topic: str,
    subscribers: Sequence[Subscriber],
    scheduler_timeout_s: float,
) -> Iterator[None]:
    """Hand the group's progress events to each subscriber while it runs, then those that had
    not arrived yet (events reach subscribers asynchronously; the scheduler keeps them, and
    answers within `scheduler_timeout_s` unless it is gone).

    Each event reaches every subscriber once, in the order sent; one subscriber failing
    neither stops the others nor the launch.
    """
    if not subscribers:
        yield
        return
    seen: set[tuple[float, str]] = set()
    # The client's event loop delivers while the group runs, this thread the last ones.
    lock = threading.Lock()

    def deliver(event: tuple[float, Any]) -> None:
        key = (event[0], str(event[1]))
        progress = Progress.from_event(event[1])
        with lock:
            if key in seen or progress is None:
                return
            seen.add(key)
            for subscriber in subscribers:
                try:
                    subscriber(progress)
                except Exception as error:  # noqa: BLE001 - runs on the client's event loop
                    log.debug("progress subscriber failed: %s", error)

    # An event sent before the subscription reaches the scheduler is delivered at the end.
    client.subscribe_topic(topic, deliver)
    try:
        yield
    finally:
        client.unsubscribe_topic(topic)
        try:
            # client.get_events() would wait for the scheduler without a bound.
            assert client.scheduler is not None  # a connected client has one
            events = client.sync(
                client.scheduler.events, topic=topic, callback_timeout=scheduler_timeout_s
            )
            for event in events:
                deliver(event)
        except Exception as error:  # noqa: BLE001 - progress must never fail the launch
            log.debug("could not fetch the last progress events of %s: %s", topic, error)
