"""Sums over the training steps between two per-step metric log lines (MLflow)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


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
