"""Rank 0's progress during fit(): lines for the flow's log and step counts for its view."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ddpflow.distributed.context import RankContext
from ddpflow.training.progress.events import StepProgress, StepReporter

if TYPE_CHECKING:
    from ddpflow.training.result import EpochStats


class FitProgress:
    """Rank 0's progress lines for the flow's log (RankContext.report): one per epoch, and
    within an epoch one at most every `every_s` seconds, so short epochs stay quiet. The
    step counts also go to `reporter` (its own rate limit) for the flow's progress view."""

    def __init__(
        self,
        ctx: RankContext,
        epochs: int,
        steps_per_epoch: int,
        reporter: StepReporter | None = None,
        every_s: float = 30,
    ):
        self.ctx, self.epochs, self.steps = ctx, epochs, steps_per_epoch
        self.reporter = reporter if ctx.is_main else None
        self.every_s = every_s
        self.last = time.monotonic()

    def _send(
        self, epoch: int, steps_done: int, train_loss: float, val_loss: float | None = None
    ) -> None:
        if self.reporter is not None:
            progress = StepProgress(
                step=steps_done,
                total_steps=self.epochs * self.steps,
                epoch=epoch,
                epochs=self.epochs,
                train_loss=train_loss,
                val_loss=val_loss,
            )
            self.reporter.report(progress, force=val_loss is not None)

    def report(self, message: str) -> None:
        if self.ctx.is_main:
            self.ctx.report(message)
            self.last = time.monotonic()

    def step(self, epoch: int, step: int, train_loss: float) -> None:
        self._send(epoch + 1, epoch * self.steps + step, train_loss)
        if time.monotonic() - self.last >= self.every_s:
            self.report(
                f"epoch {epoch + 1}/{self.epochs}: step {step}/{self.steps} "
                f"({100 * step / self.steps:.0f} %), train loss {train_loss:.4f}"
            )

    def epoch_done(self, stats: EpochStats) -> None:
        self._send(stats.epoch, stats.epoch * self.steps, stats.train_loss, stats.val_loss)
        extra = "".join(f", {k} {v:.4f}" for k, v in stats.val_metrics.items())
        self.report(
            f"epoch {stats.epoch}/{self.epochs} done: train loss {stats.train_loss:.4f}, "
            f"val loss {stats.val_loss:.4f}{extra}, {stats.samples_per_s:,.0f} samples/s, "
            f"{stats.epoch_time_s:.1f} s"
        )
