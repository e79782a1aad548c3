"""fit_loop(): the training loop under ddpflow.fit. It receives built objects; it parses no
config and builds nothing.

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
from torch import nn

from ddpflow.checkpoint.steps import (
    CheckpointClock,
    CheckpointSchedule,
    EpochPosition,
    StepCheckpointer,
    gather_loss_sums,
    step_seed,
)
from ddpflow.checkpoint.store import unwrap
from ddpflow.distributed.context import RankContext
from ddpflow.distributed.supervisor.graceful_stop import StopRequested
from ddpflow.tracking.loggers import MetricLogger, flush_logger
from ddpflow.training.batching import epoch_batches, step_sizes
from ddpflow.training.fit_progress import FitProgress
from ddpflow.training.result import EpochStats
from ddpflow.training.samples import Samples
from ddpflow.training.speed.device import TrainSpeed
from ddpflow.training.step_window import StepWindow
from ddpflow.training.validation import Loss, all_reduce_sum, evaluate_loss, forward

Evaluate = Callable[[nn.Module], Mapping[str, float]]
StepMetrics = Callable[[torch.Tensor, torch.Tensor], Mapping[str, float]]
# save_checkpoint(epochs_done) at an epoch end, (epochs_done, position) inside an epoch.
SaveCheckpoint = Callable[..., None]


@dataclass(frozen=True)
class FitPlan:
    epochs: int
    batch_size: int
    seed: int
    start_epoch: int = 0
    log_every_steps: int = 20
    eval_batch_size: int = 8192
    checkpoints: CheckpointSchedule = field(default_factory=CheckpointSchedule)
    resume_at: EpochPosition | None = None  # from a checkpoint inside epoch start_epoch
    # batch_size is the group's batch per step, whatever the world size (batching.py).
    global_batch: bool = False


@dataclass(frozen=True)
class FitHooks:
    """Optional additions to fit(). Each is called on every rank, so collectives are allowed.

    evaluate: replaces evaluate_loss; gets the unwrapped model and returns metrics that are
        identical on every rank (all-reduced), including "val_loss".
    step_metrics: extra training metrics from one step's (logits, targets), e.g. accuracy;
        averaged over the logging window like train_loss.
    on_epoch_end: called after validation and before the checkpoint, so state it changes
        (a scheduler's) is in that epoch's checkpoint.
    speed: the rank's resolved speed settings (ddpflow.training.speed.device): host-to-device
        copies, autocast around the training forward, backward and step through its GradScaler.
        None: plain fp32 steps.
    loss: `loss(outputs, targets)` for a model called as `model(inputs)`; None: the model
        is called as `model(inputs, targets)` and returns (outputs, loss) itself.
    """

    evaluate: Evaluate | None = None
    step_metrics: StepMetrics | None = None
    on_epoch_end: Callable[[EpochStats], None] | None = None
    speed: TrainSpeed | None = None
    loss: Loss | None = None


def fit_loop(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train: Samples,
    val: Samples,
    ctx: RankContext,
    logger: MetricLogger,
    save_checkpoint: SaveCheckpoint,
    plan: FitPlan,
    hooks: FitHooks | None = None,
    history: list[EpochStats] | None = None,
) -> list[EpochStats]:
    """Train for plan.epochs; epochs are numbered from 1 in metrics and checkpoints.

    Each rank trains on its part of `train` (ddpflow.training.samples: a count and `batch(index)`)
    and validates on its shard of `val`.

    `save_checkpoint(epochs_done)` is called on rank 0 at each epoch end, and
    `save_checkpoint(epochs_done, position)` inside an epoch when plan.checkpoints says so.
    """
    hooks = hooks or FitHooks()
    history = [] if history is None else history
    # The count alone: drawing an epoch's order (a stream's shard windows) is not needed.
    steps_per_epoch = len(
        step_sizes(len(train), plan.batch_size, ctx.world_size, 0, plan.global_batch)
    )
    progress = FitProgress(ctx, plan.epochs, steps_per_epoch)
    position = plan.resume_at
    if position is not None and position.epoch != plan.start_epoch:
        raise ValueError(f"resume_at is inside epoch {position.epoch}, not {plan.start_epoch}")
    if position is not None:
        progress.report(resume_line(position, plan, len(train), ctx.world_size, steps_per_epoch))
    elif plan.start_epoch > 0:
        progress.report(f"resuming after epoch {plan.start_epoch}/{plan.epochs}")
    clock = CheckpointClock(plan.checkpoints, ctx.world_size, ctx.device)
    steps = StepCheckpointer(clock, save_checkpoint)
    # The global step counts the optimizer steps taken, whatever the world size was: a
    # group that grew or shrank goes on numbering from its checkpoint, so every step is
    # logged once and in order. Checkpoints from before that count fall back to the formula.
    known = history[-1].last_step if history and plan.start_epoch > 0 else None
    next_step = known if known is not None else plan.start_epoch * steps_per_epoch
    at = position.global_step if position is not None else None
    # One point per attempt: a change of size shows where it happened (a grow:
    # ddpflow.distributed.supervisor.growth).
    logger.log_metrics({"world_size": float(ctx.world_size)}, step=next_step if at is None else at)
    for epoch in range(plan.start_epoch, plan.epochs):
        started = time.perf_counter()
        train_loss, ran_samples, next_step = _train_epoch(
            model=model,
            optimizer=optimizer,
            data=train,
            ctx=ctx,
            logger=logger,
            plan=plan,
            epoch=epoch,
            first_step=next_step,
            steps_per_epoch=steps_per_epoch,
            step_metrics=hooks.step_metrics,
            progress=progress,
            speed=hooks.speed,
            loss_fn=hooks.loss,
            resume_at=position,
            checkpoints=steps,
        )
        resumed_at = (
            None
            if position is None
            else steps_done_at(position, plan, len(train), ctx.world_size, steps_per_epoch)
        )
        position = None
        elapsed = time.perf_counter() - started
        val_metrics = _validate(model, val, ctx, plan, hooks)
        val_loss = val_metrics.pop("val_loss")
        # The rate and the time count one span: the steps this attempt ran. An epoch resumed
        # from a checkpoint inside it counts the samples since the resume over the seconds
        # since the resume, never the whole epoch's samples over part of its time.
        stats = EpochStats(
            epoch + 1,
            train_loss,
            val_loss,
            ran_samples / elapsed,
            elapsed,
            val_metrics,
            last_step=next_step,
            resumed_at_step=resumed_at,
        )
        _log_epoch(logger, stats)
        progress.epoch_done(stats)
        if hooks.on_epoch_end is not None:
            hooks.on_epoch_end(stats)
        history.append(stats)  # before the checkpoint, which carries it (ddpflow.fit)
        # Nobody starts the next epoch before its checkpoint exists: a restart resumes there.
        with ctx.rank0_io("checkpoint"):
            if ctx.is_main:
                flush_logger(logger)  # a resume never re-logs the epochs before its checkpoint
                save_checkpoint(stats.epoch)
        clock.written()
        ctx.heartbeat()  # validation and the checkpoint write are done
        # A stop asked for during the epoch (a leaving worker, a grow) is taken here too: an
        # epoch shorter than a control interval has no control step inside it.
        if epoch + 1 < plan.epochs and (stop := clock.stop_requested()) is not None:
            raise StopRequested(stop, epoch=epoch + 1)
    return history


def steps_done_at(
    position: EpochPosition, plan: FitPlan, num_samples: int, world_size: int, per_epoch: int
) -> int:
    """The steps of the epoch a checkpoint inside it had done, in `world_size`'s steps.

    Another size cuts the epoch into other steps: 540 steps at 2 ranks are 360 at 3. The
    samples done are what both sizes agree on, so the steps left at this size come from them.
    """
    if position.world_size == world_size:
        return position.step
    left = step_sizes(num_samples, plan.batch_size, world_size, position.samples, plan.global_batch)
    return max(0, per_epoch - len(left))


def resume_line(
    position: EpochPosition, plan: FitPlan, num_samples: int, world_size: int, per_epoch: int
) -> str:
    """The resume's progress line: its step and the epoch's steps at one world size (this
    one), and the checkpoint's own step when it was written at another size."""
    done = steps_done_at(position, plan, num_samples, world_size, per_epoch)
    line = (
        f"resuming at epoch {position.epoch + 1}/{plan.epochs}, step {done}/{per_epoch} "
        f"at {world_size} rank(s) (a checkpoint inside the epoch"
    )
    if position.world_size != world_size:
        line += f", written at step {position.step} of {position.world_size} rank(s)"
    return line + ")"


def _validate(
    model: nn.Module, val: Samples, ctx: RankContext, plan: FitPlan, hooks: FitHooks
) -> dict[str, float]:
    if hooks.evaluate is not None:
        metrics = dict(hooks.evaluate(unwrap(model)))
        if "val_loss" not in metrics:
            raise ValueError(f"FitHooks.evaluate must return 'val_loss', got {sorted(metrics)}")
        return metrics
    loss = evaluate_loss(unwrap(model), val, ctx, plan.eval_batch_size, hooks.loss)
    return {"val_loss": loss}


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


def _batches(
    data: Samples, plan: FitPlan, ctx: RankContext, epoch: int, start: int = 0
) -> list[torch.Tensor]:
    return epoch_batches(
        len(data),
        plan.batch_size,
        ctx.rank,
        ctx.world_size,
        plan.seed,
        epoch,
        start,
        global_batch=plan.global_batch,
        order=getattr(data, "epoch_order", None),  # samples.StreamedSamples
    )


def _train_epoch(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Samples,
    ctx: RankContext,
    logger: MetricLogger,
    plan: FitPlan,
    epoch: int,
    first_step: int,
    steps_per_epoch: int,
    step_metrics: StepMetrics | None = None,
    progress: FitProgress | None = None,
    resume_at: EpochPosition | None = None,
    checkpoints: StepCheckpointer | None = None,
    speed: TrainSpeed | None = None,
    loss_fn: Loss | None = None,
) -> tuple[float, int, int]:
    """One epoch (or its rest, from `resume_at`): (the epoch's mean training loss, the samples
    this call trained on over all ranks, the global step after its last step). `first_step`
    is the global step it starts after."""
    speed = speed or TrainSpeed(device=ctx.device)
    model.train()
    loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of loss * samples, samples)
    window = StepWindow()
    done, start, ran = 0, 0, 0
    if resume_at is not None:  # go on where the checkpoint inside this epoch left off
        start = resume_at.samples
        loss_sum = resume_at.loss_sum_for(ctx.rank, ctx.world_size)
        if ctx.is_main:  # rank 0's window: the next log line averages the same steps
            window = StepWindow.from_state(resume_at.window)
    batches = _batches(data, plan, ctx, epoch, start)
    if (start_epoch := getattr(data, "start_epoch", None)) is not None:
        start_epoch(epoch, batches)  # samples.StreamedSamples
    if resume_at is not None:
        done = steps_done_at(resume_at, plan, len(data), ctx.world_size, steps_per_epoch)
        if resume_at.global_step is not None:
            first_step = resume_at.global_step - done
    end = done + len(batches)
    step_samples = plan.batch_size if plan.global_batch else plan.batch_size * ctx.world_size
    # With a global batch, each rank's loss is weighted by its share of the step's samples
    # (rank_samples * world_size / step_samples): DDP's mean over the ranks is then the mean
    # over the step's samples, as on any other world size, even where a rank has one more.
    totals = (
        step_sizes(len(data), plan.batch_size, ctx.world_size, start, True)
        if plan.global_batch
        else []
    )
    for i, index in enumerate(batches, start=done):
        # Dropout (any torch RNG use) depends only on (seed, rank, epoch, step): a resume
        # from any checkpoint, inside an epoch or at its end, repeats the same draws.
        torch.manual_seed(step_seed(plan.seed, ctx.rank, epoch, i))
        x, y = data.batch(index)
        x, y = speed.to_device(x), speed.to_device(y)
        optimizer.zero_grad(set_to_none=True)
        with speed.autocast():
            logits, loss = forward(model, x, y, loss_fn)
        if plan.global_batch:
            loss_for_step = loss * (len(index) * ctx.world_size / totals[i - done])
        else:
            loss_for_step = loss
        speed.backward_and_step(loss_for_step, optimizer)
        ctx.heartbeat(first_step + i + 1)  # the launcher fails a rank that stops stepping
        batch_loss = loss.item()
        loss_sum += torch.tensor([batch_loss * len(index), len(index)], dtype=torch.float64)
        ran += len(index)
        extra = step_metrics(logits.detach(), y) if step_metrics is not None else {}
        window.add(batch_loss, len(index), extra)
        if (i + 1) % plan.log_every_steps == 0:
            metrics = window.metrics(ctx.world_size)
            logger.log_metrics(metrics, step=first_step + i + 1)
            if progress is not None:
                progress.step(epoch, i + 1, metrics["train_loss"])
            window = StepWindow()
        if checkpoints is None or i + 1 == end:
            continue  # an epoch's last step: its epoch-end checkpoint follows
        due, stop = checkpoints.clock.check(i + 1)
        if due:
            sums = gather_loss_sums(loss_sum, ctx.world_size, ctx.device)
            samples = start + (i + 1 - done) * step_samples  # all steps but the last are full
            position = EpochPosition(
                epoch, i + 1, samples, ctx.world_size, sums, window.state(), first_step + i + 1
            )
            checkpoints.write(ctx, logger, position)
        if stop is not None:
            raise StopRequested(stop, epoch=epoch + 1, step=i + 1)
    # One collective for both: the epoch's loss sums (the checkpoint's part included) and
    # the samples this call ran (the epoch's rate counts these only).
    summed = torch.cat([loss_sum, torch.tensor([float(ran)], dtype=torch.float64)])
    all_reduce_sum(summed, ctx)
    return float(summed[0] / summed[1]), int(summed[2]), first_step + end
