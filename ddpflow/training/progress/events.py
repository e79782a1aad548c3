"""Where a training stands, from rank 0 to the flow process, as Dask events.

Rank 0 sends a `StepProgress` on the run's topic (keyed by the MLflow run id, so it is the
same topic across restarts) at most every few seconds and at each epoch's end; the flow
process follows the topic (ddpflow.integrations.prefect.progress_artifact) and shows it in
Prefect. Sending is a local call on the worker: it never blocks or fails a step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

TOPIC_PREFIX = "ddpflow-training-progress-"
DEFAULT_EVERY_S = 2.0


def progress_topic(run_id: str) -> str:
    return f"{TOPIC_PREFIX}{run_id}"


@dataclass(frozen=True)
class StepProgress:
    step: int  # global optimizer steps done, counted over all epochs
    total_steps: int
    epoch: int  # the epoch under way (1-based)
    epochs: int
    train_loss: float
    val_loss: float | None = None  # set once an epoch's validation is done

    @property
    def percent(self) -> float:
        return 100.0 * min(1.0, self.step / self.total_steps) if self.total_steps else 0.0

    def describe(self) -> str:
        text = (
            f"epoch {self.epoch}/{self.epochs}, step {self.step}/{self.total_steps} "
            f"({self.percent:.0f} %), train loss {self.train_loss:.4f}"
        )
        return text + (f", val loss {self.val_loss:.4f}" if self.val_loss is not None else "")

    def to_event(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_event(cls, event: Any) -> StepProgress | None:
        """The progress in a Dask event's payload; None for anything else.

        Dask adds the sender's address ("worker") to a dict it delivers: extra keys are
        ignored.
        """
        if not isinstance(event, dict):
            return None
        try:
            return cls(**{k: event[k] for k in cls.__dataclass_fields__ if k in event})
        except TypeError:
            return None


class StepReporter:
    """Rank 0's sender: one event at most every `every_s` seconds, epoch ends always."""

    def __init__(self, topic: str | None, every_s: float = DEFAULT_EVERY_S):
        self.topic = topic
        self.every_s = every_s
        self._last = float("-inf")

    def report(self, progress: StepProgress, force: bool = False) -> None:
        if self.topic is None:
            return
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        try:
            import distributed

            distributed.get_worker().log_event(self.topic, progress.to_event())
        except (ValueError, RuntimeError):  # not in a Dask worker: nobody follows
            pass


class StepWindow:
    """Sums over the steps between two per-step log lines."""

    def __init__(self) -> None:
        self.loss, self.samples, self.steps = 0.0, 0, 0
        self.extra: dict[str, float] = {}
        self.start = time.perf_counter()

    def add(self, loss: float, samples: int, extra: Mapping[str, float]) -> None:
        self.loss += loss
        self.samples += samples
        self.steps += 1
        for key, value in extra.items():
            self.extra[key] = self.extra.get(key, 0.0) + float(value)

    def state(self) -> dict[str, Any]:
        """The sums, for a checkpoint inside an epoch (the clock starts afresh on resume)."""
        return {
            "loss": self.loss,
            "samples": self.samples,
            "steps": self.steps,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StepWindow:
        window = cls()
        if state:
            window.loss, window.samples, window.steps = (
                state["loss"],
                state["samples"],
                state["steps"],
            )
            window.extra = dict(state["extra"])
        return window

    def metrics(self, world_size: int) -> dict[str, float]:
        return {
            "train_loss": self.loss / self.steps,
            # Ranks step in lockstep, so rank 0's rate times the world size is global.
            "samples_per_s": self.samples * world_size / (time.perf_counter() - self.start),
            **{key: total / self.steps for key, total in self.extra.items()},
        }
