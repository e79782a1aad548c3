"""fit(): the training loop. It receives built objects; it parses no config and builds nothing.

Works unchanged for 1 and N ranks: collectives on a group of one are no-ops, and the only
rank-dependent behaviour (logging, checkpoint writes) comes in through `logger` (a no-op on
ranks other than 0) and `save_checkpoint`, which is called on rank 0 only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.batching import epoch_batches, shard
from ddpflow.checkpoint import unwrap
from ddpflow.distributed.context import RankContext
from ddpflow.tracking import MetricLogger

Batch = tuple[torch.Tensor, torch.Tensor]
ToBatch = Callable[[torch.Tensor], Batch]


@dataclass(frozen=True)
class FitPlan:
    epochs: int
    batch_size: int
    seed: int
    start_epoch: int = 0
    log_every_steps: int = 20
    eval_batch_size: int = 8192


@dataclass(frozen=True)
class EpochStats:
    epoch: int
    train_loss: float
    val_loss: float
    samples_per_s: float
    epoch_time_s: float


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
) -> list[EpochStats]:
    """Train for plan.epochs; epochs are numbered from 1 in metrics and checkpoints."""
    history = []
    steps_per_epoch = len(_batches(train_data, plan, ctx, 0))
    for epoch in range(plan.start_epoch, plan.epochs):
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
        )
        elapsed = time.perf_counter() - started
        val_loss = evaluate_loss(unwrap(model), val_data, to_batch, ctx, plan.eval_batch_size)
        stats = EpochStats(epoch + 1, train_loss, val_loss, num_samples / elapsed, elapsed)
        logger.log_metrics(
            {
                "epoch_train_loss": stats.train_loss,
                "val_loss": stats.val_loss,
                "epoch_samples_per_s": stats.samples_per_s,
                "epoch_time_s": stats.epoch_time_s,
            },
            step=stats.epoch,
        )
        if ctx.is_main:
            save_checkpoint(stats.epoch)
        # Nobody starts the next epoch before its checkpoint exists: a restart resumes there.
        _barrier(ctx)
        history.append(stats)
    return history


def _batches(data: torch.Tensor, plan: FitPlan, ctx: RankContext, epoch: int) -> list:
    return epoch_batches(len(data), plan.batch_size, ctx.rank, ctx.world_size, plan.seed, epoch)


def _train_epoch(model, optimizer, data, to_batch, ctx, logger, plan, epoch, first_step):
    model.train()
    loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of loss * samples, samples)
    window_loss, window_samples, window_start = 0.0, 0, time.perf_counter()
    for i, index in enumerate(_batches(data, plan, ctx, epoch)):
        x, y = to_batch(data[index])
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        batch_loss = loss.item()
        loss_sum += torch.tensor([batch_loss * len(index), len(index)], dtype=torch.float64)
        window_loss += batch_loss
        window_samples += len(index)
        if (i + 1) % plan.log_every_steps == 0:
            window_s = time.perf_counter() - window_start
            logger.log_metrics(
                {
                    "train_loss": window_loss / plan.log_every_steps,
                    # Ranks step in lockstep, so rank 0's rate times the world size is global.
                    "samples_per_s": window_samples * ctx.world_size / window_s,
                },
                step=first_step + i + 1,
            )
            window_loss, window_samples, window_start = 0.0, 0, time.perf_counter()
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
