"""Rank 0's progress during fit(), as events on the group's one progress channel.

Each event is a ddpflow.distributed.progress.Progress: the launcher hands it to every
subscriber, the log-line callback (its `line`) and the Prefect progress artifact (its step
counts). Sending is a local call on the worker: it never blocks or fails a step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ddpflow.distributed.context import RankContext
from ddpflow.distributed.progress import Progress

if TYPE_CHECKING:
    from ddpflow.training.result import EpochStats

LINES_EVERY_S = 30.0  # a log line within an epoch: short epochs stay quiet
STEPS_EVERY_S = 2.0  # step counts for the progress artifact


class FitProgress:
    """Rank 0's progress events: within an epoch, step counts at most every `steps_every_s`
    seconds and a log line at most every `lines_every_s`; both at each epoch's end, always.
    The other ranks send nothing."""

    def __init__(
        self,
        ctx: RankContext,
        epochs: int,
        steps_per_epoch: int,
        lines_every_s: float = LINES_EVERY_S,
        steps_every_s: float = STEPS_EVERY_S,
    ):
        self.ctx, self.epochs, self.steps = ctx, epochs, steps_per_epoch
        self.lines_every_s, self.steps_every_s = lines_every_s, steps_every_s
        self.last_line = time.monotonic()
        self.last_steps = float("-inf")

    def report(self, message: str) -> None:
        """A line without step counts (a resume)."""
        if self.ctx.is_main:
            self.ctx.send(Progress(line=message))
            self.last_line = time.monotonic()

    def step(self, epoch: int, step: int, train_loss: float) -> None:
        if not self.ctx.is_main:
            return
        now = time.monotonic()
        line = None
        if now - self.last_line >= self.lines_every_s:
            line = (
                f"epoch {epoch + 1}/{self.epochs}: step {step}/{self.steps} "
                f"({100 * step / self.steps:.0f} %), train loss {train_loss:.4f}"
            )
            self.last_line = now
        elif now - self.last_steps < self.steps_every_s:
            return
        self.last_steps = now
        self.ctx.send(self._progress(epoch + 1, epoch * self.steps + step, train_loss, line))

    def epoch_done(self, stats: EpochStats) -> None:
        if not self.ctx.is_main:
            return
        extra = "".join(f", {k} {v:.4f}" for k, v in stats.val_metrics.items())
        line = (
            f"epoch {stats.epoch}/{self.epochs} done: train loss {stats.train_loss:.4f}, "
            f"val loss {stats.val_loss:.4f}{extra}, {stats.samples_per_s:,.0f} samples/s, "
            f"{stats.epoch_time_s:.1f} s"
        )
        if stats.resumed_at_step is not None:  # the rate and time are the resumed part's
            line += f" (the steps since the resume at step {stats.resumed_at_step})"
        done = stats.epoch * self.steps
        self.ctx.send(self._progress(stats.epoch, done, stats.train_loss, line, stats.val_loss))
        self.last_line = self.last_steps = time.monotonic()

    def _progress(
        self,
        epoch: int,
        steps_done: int,
        train_loss: float,
        line: str | None,
        val_loss: float | None = None,
    ) -> Progress:
        return Progress(
            line=line,
            step=steps_done,
            total_steps=self.epochs * self.steps,
            epoch=epoch,
            epochs=self.epochs,
            train_loss=train_loss,
            val_loss=val_loss,
        )
