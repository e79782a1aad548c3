"""fit(): the training loop. It receives built objects; it parses no config and builds nothing.

Works unchanged for 1 and N ranks: collectives on a group of one are no-ops, and the only
rank-dependent behaviour (logging, checkpoint writes) comes in through `logger` (a no-op on
ranks other than 0) and `save_checkpoint`, which is called on rank 0 only.

Optional `FitHooks` let a workload add what its loop needs without a second loop: its own
validation (e.g. loss and accuracy in one pass), extra per-step metrics (accuracy, lr) and an
end-of-epoch step (e.g. ReduceLROnPlateau), which runs before the epoch's checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.batching import epoch_batches, shard
from ddpflow.checkpoint import unwrap
from ddpflow.distributed.context import RankContext
from ddpflow.speed import TrainSpeed
from ddpflow.tracking import MetricLogger, flush_logger
from ddpflow.training_progress import StepProgress, StepReporter, StepWindow

Batch = tuple[torch.Tensor, torch.Tensor]
ToBatch = Callable[[torch.Tensor], Batch]
Evaluate = Callable[[nn.Module], Mapping[str, float]]
StepMetrics = Callable[[torch.Tensor, torch.Tensor], Mapping[str, float]]


@dataclass(frozen=True)
class FitPlan:
    epochs: int
    batch_size: int
    seed: int
    start_epoch: int = 0
    log_every_steps: int = 20
    eval_batch_size: int = 8192
    # Dask event topic for rank 0's step progress (ddpflow.training_progress); None: not sent.
    progress_topic: str | None = None


@dataclass(frozen=True)
class EpochStats:
    epoch: int
    train_loss: float
    val_loss: float
    samples_per_s: float
    epoch_time_s: float
    val_metrics: dict[str, float] = field(default_factory=dict)  # besides val_loss (hooks)


@dataclass(frozen=True)
class FitHooks:
    """Optional additions to fit(). Each is called on every rank, so collectives are allowed.

    evaluate: replaces evaluate_loss; gets the unwrapped model and returns metrics that are
        identical on every rank (all-reduced), including "val_loss".
    step_metrics: extra training metrics from one step's (logits, targets), e.g. accuracy;
        averaged over the logging window like train_loss.
    on_epoch_end: called after validation and before the checkpoint, so state it changes
        (a scheduler's) is in that epoch's checkpoint.
    speed: the rank's resolved speed settings (ddpflow.speed): host-to-device copies,
        autocast around the training forward, backward and step through its GradScaler.
        None: plain fp32 steps.
    """

    evaluate: Evaluate | None = None
    step_metrics: StepMetrics | None = None
    on_epoch_end: Callable[[EpochStats], None] | None = None
    speed: TrainSpeed | None = None


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_data: torch.Tensor,
    val_data: torch.Tensor,
    to_batch: ToBatch,
    ctx: RankContext,
    logger: MetricLogger,
    save_checkpoint: Callable[[int], None],
    plan: FitPlan,
    hooks: FitHooks | None = None,
) -> list[EpochStats]:
    """Train for plan.epochs; epochs are numbered from 1 in metrics and checkpoints."""
    hooks = hooks or FitHooks()
    history = []
    steps_per_epoch = len(_batches(train_data, plan, ctx, 0))
    progress = _Progress(ctx, plan.epochs, steps_per_epoch, StepReporter(plan.progress_topic))
    if plan.start_epoch > 0:
        progress.report(f"resuming after epoch {plan.start_epoch}/{plan.epochs}")
    for epoch in range(plan.start_epoch, plan.epochs):
        # Dropout (and any other torch RNG use) depends only on (seed, rank, epoch): a run
        # resumed from an epoch's checkpoint continues exactly as if never interrupted.
        torch.manual_seed(epoch_seed(plan.seed, ctx.rank, epoch))
        started = time.perf_counter()
        train_loss, num_samples = _train_epoch(
            model,
            optimizer,
            train_data,
            to_batch,
            ctx,
            logger,
            plan,
            epoch,
            first_step=epoch * steps_per_epoch,
            step_metrics=hooks.step_metrics,
            progress=progress,
            speed=hooks.speed,
        )
        elapsed = time.perf_counter() - started
        val_metrics = _validate(model, val_data, to_batch, ctx, plan, hooks)
        val_loss = val_metrics.pop("val_loss")
        stats = EpochStats(
            epoch + 1, train_loss, val_loss, num_samples / elapsed, elapsed, val_metrics
        )
        _log_epoch(logger, stats)
        progress.epoch_done(stats)
        if hooks.on_epoch_end is not None:
            hooks.on_epoch_end(stats)
        if ctx.is_main:
            flush_logger(logger)  # a resume never re-logs the epochs before its checkpoint
            save_checkpoint(stats.epoch)
        # Nobody starts the next epoch before its checkpoint exists: a restart resumes there.
        _barrier(ctx)
        ctx.heartbeat()  # validation and the checkpoint write are done
        history.append(stats)
    return history


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    return (seed * 1_000_003 + rank * 7919 + epoch) % (2**63)


def _validate(model, val_data, to_batch, ctx, plan, hooks: FitHooks) -> dict[str, float]:
    if hooks.evaluate is not None:
        metrics = dict(hooks.evaluate(unwrap(model)))
        if "val_loss" not in metrics:
            raise ValueError(f"FitHooks.evaluate must return 'val_loss', got {sorted(metrics)}")
        return metrics
    return {"val_loss": evaluate_loss(unwrap(model), val_data, to_batch, ctx, plan.eval_batch_size)}


def _log_epoch(logger: MetricLogger, stats: EpochStats) -> None:
    logger.log_metrics(
        {
            "epoch_train_loss": stats.train_loss,
            "val_loss": stats.val_loss,
            "epoch_samples_per_s": stats.samples_per_s,
            "epoch_time_s": stats.epoch_time_s,
            **stats.val_metrics,
        },
        step=stats.epoch,
    )


def _batches(data: torch.Tensor, plan: FitPlan, ctx: RankContext, epoch: int) -> list:
    return epoch_batches(len(data), plan.batch_size, ctx.rank, ctx.world_size, plan.seed, epoch)


class _Progress:
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


def _train_epoch(
    model,
    optimizer,
    data,
    to_batch,
    ctx,
    logger,
    plan,
    epoch,
    first_step,
    step_metrics=None,
    progress: _Progress | None = None,
    speed: TrainSpeed | None = None,
):
    speed = speed or TrainSpeed(device=ctx.device)
    model.train()
    loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of loss * samples, samples)
    window = StepWindow()
    for i, index in enumerate(_batches(data, plan, ctx, epoch)):
        x, y = to_batch(data[index])
        x, y = speed.to_device(x), speed.to_device(y)
        optimizer.zero_grad(set_to_none=True)
        with speed.autocast():
            logits, loss = model(x, y)
        speed.backward_and_step(loss, optimizer)
        ctx.heartbeat()  # the launcher fails a rank that stops stepping
        batch_loss = loss.item()
        loss_sum += torch.tensor([batch_loss * len(index), len(index)], dtype=torch.float64)
        extra = step_metrics(logits.detach(), y) if step_metrics is not None else {}
        window.add(batch_loss, len(index), extra)
        if (i + 1) % plan.log_every_steps == 0:
            metrics = window.metrics(ctx.world_size)
            logger.log_metrics(metrics, step=first_step + i + 1)
            if progress is not None:
                progress.step(epoch, i + 1, metrics["train_loss"])
            window = StepWindow()
    _all_reduce_sum(loss_sum, ctx)
    return float(loss_sum[0] / loss_sum[1]), int(loss_sum[1])


@torch.no_grad()
def evaluate_loss(
    model: nn.Module, data: torch.Tensor, to_batch: ToBatch, ctx: RankContext, batch_size: int
) -> float:
    """Mean per-symbol loss over `data`, each rank scoring its own shard."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    index = shard(len(data), ctx.rank, ctx.world_size)
    for chunk in index.split(batch_size):
        x, y = to_batch(data[chunk])
        _, loss = model(x.to(ctx.device), y.to(ctx.device))
        totals += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
        ctx.heartbeat()  # a long validation is progress too
    model.train(was_training)
    _all_reduce_sum(totals, ctx)
    return float(totals[0] / totals[1]) if totals[1] else float("nan")


def _all_reduce_sum(tensor: torch.Tensor, ctx: RankContext) -> None:
    if ctx.world_size > 1:
        # gloo reduces CPU tensors; nccl needs them on the GPU.
        moved = tensor.to(ctx.device)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        tensor.copy_(moved.cpu())


def _barrier(ctx: RankContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()
