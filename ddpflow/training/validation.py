"""Validation for fit(): the mean loss over each rank's shard, summed over the group.

Also the one place that calls a model for a loss, so training and validation call it the
same way: `model(inputs, targets) -> (outputs, loss)`, or `loss(model(inputs), targets)`
with a FitHooks.loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.distributed.context import RankContext
from ddpflow.training.batching import shard
from ddpflow.training.samples import Samples

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def forward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Loss | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs, loss): from the model itself, or from `loss_fn` on its outputs."""
    if loss_fn is None:
        return model(x, y)
    outputs = model(x)
    return outputs, loss_fn(outputs, y)


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    data: Samples,
    ctx: RankContext,
    batch_size: int,
    loss_fn: Loss | None = None,
) -> float:
    """Mean loss per sample over `data`, each rank scoring its own shard."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    index = shard(len(data), ctx.rank, ctx.world_size)
    for chunk in index.split(batch_size):
        x, y = data.batch(chunk)
        _, loss = forward(model, x.to(ctx.device), y.to(ctx.device), loss_fn)
        totals += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
        ctx.heartbeat()  # a long validation is progress too
    model.train(was_training)
    all_reduce_sum(totals, ctx)
    return float(totals[0] / totals[1]) if totals[1] else float("nan")


def all_reduce_sum(tensor: torch.Tensor, ctx: RankContext) -> None:
    if ctx.world_size > 1:
        # gloo reduces CPU tensors; nccl needs them on the GPU.
        moved = tensor.to(ctx.device)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        tensor.copy_(moved.cpu())
