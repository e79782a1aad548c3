"""Classification metrics: loss and accuracy over a split (sharded over ranks), confusion."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpflow.distributed.context import RankContext
from ddpflow.training.batching import shard
from ddpflow.training.samples import Samples


def scored_batches(
    model: nn.Module,
    split: Samples,
    index: torch.Tensor,
    batch_size: int,
    on_batch: Callable[[], None] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, labels) of the samples at `index`, one batch at a time, in eval mode (on the
    model's device), each batch read through `split.batch` (in memory, or a streamed split's
    shards); `on_batch` is called after each batch (a rank's heartbeat: a long validation is
    progress too). A caller that keeps nothing of a batch holds one batch at a time."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for chunk in index.split(batch_size):
            images, targets = split.batch(chunk)
            with torch.no_grad():
                logits = model(images.to(device))[0]
            yield logits, targets.to(device)
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)


def predict(
    model: nn.Module,
    split: Samples,
    index: torch.Tensor,
    batch_size: int,
    on_batch: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of the samples at `index`, all of them (CPU tensors): for reports
    that need every prediction (a confusion matrix). Validation keeps sums instead."""
    logits, labels = [], []
    for batch_logits, targets in scored_batches(model, split, index, batch_size, on_batch):
        logits.append(batch_logits.cpu())
        labels.append(targets.cpu())
    if not logits:
        return torch.empty(0), torch.empty(0, dtype=torch.int64)
    return torch.cat(logits), torch.cat(labels)


def evaluate_split(
    model: nn.Module, split: Samples, ctx: RankContext, batch_size: int
) -> dict[str, float]:
    """val_loss and val_accuracy over the whole split, each rank scoring its own shard.

    Sums are kept per batch (loss, correct, count), never the batches' logits: a rank's
    memory during validation is bounded by one batch, whatever the split's size."""
    index = shard(len(split), ctx.rank, ctx.world_size)
    totals = torch.zeros(3, dtype=torch.float64)
    for logits, labels in scored_batches(model, split, index, batch_size, ctx.heartbeat):
        loss = F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct = (logits.argmax(1) == labels).sum().item()
        totals += torch.tensor([loss, correct, len(labels)], dtype=torch.float64)
    if ctx.world_size > 1:
        moved = totals.to(ctx.device)  # nccl reduces GPU tensors, gloo CPU ones
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        totals = moved.cpu()
    loss_sum, correct, count = totals.tolist()
    if not count:
        return {"val_loss": float("nan"), "val_accuracy": float("nan")}
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count}


def batch_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return (logits.argmax(1) == targets).float().mean().item()


def confusion_matrix(targets: torch.Tensor, predictions: torch.Tensor, num_classes: int) -> list:
    """counts[true][predicted] as nested lists of ints."""
    flat = targets.long() * num_classes + predictions.long()
    counts = torch.bincount(flat, minlength=num_classes * num_classes)
    return counts.view(num_classes, num_classes).tolist()
