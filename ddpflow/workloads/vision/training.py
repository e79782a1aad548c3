"""The rank entry point for image classification: build objects from a job, then ddpflow.fit().

Like the pet-name model's, a training function of the public API on a TrainContext.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from ddpflow.distributed.context import RankContext
from ddpflow.training.context import TrainContext
from ddpflow.training.loop import FitHooks
from ddpflow.training.result import EpochStats, TrainResult
from ddpflow.training.samples import Samples
from ddpflow.training.speed.device import TrainSpeed, announce, resolve_speed
from ddpflow.training.speed.settings import SpeedError
from ddpflow.workloads.fit_job import fit_job
from ddpflow.workloads.vision.augment import AugmentedSamples
from ddpflow.workloads.vision.data import open_split
from ddpflow.workloads.vision.job import ImageTrainJob
from ddpflow.workloads.vision.metrics import batch_accuracy, evaluate_split
from ddpflow.workloads.vision.model import (
    ImageClassifier,
    build_resnet,
    trainable_parameters,
)


def make_optimizer(
    kind: str, params: list, lr: float, fused: bool = False
) -> torch.optim.Optimizer:
    """`fused`: one kernel per step for every parameter (TrainSpeed.fused_optimizer). Not
    fused is None, not False: torch then picks its foreach kernels where the device has them."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, fused=fused or None)
    if kind == "sgd":
        # Momentum 0.9: the choice of Saturn Cloud's transfer-learning tutorial.
        return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=fused or None)
    raise ValueError(f"optimizer={kind!r} is not one of adam, sgd")


# On CPUs with AVX-512 bf16 (seen on a Sapphire Rapids Xeon, torch 2.14.1), oneDNN computes
# the bf16 weight gradient of a stride-2 convolution whose input is 1x1 from uninitialised
# memory: weights of 1e24 after a few steps, different in every run. A ResNet's last stage
# gets a 1x1 input at 16 px or less; at 17 px and more every strided input is 2x2 or larger.
MIN_CPU_BF16_IMAGE_SIZE = 17


@dataclass
class _Trainer:
    """The built objects of one rank."""

    model: ImageClassifier
    ddp_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: ReduceLROnPlateau
    lr: float
    speed: TrainSpeed


def _build(ctx: TrainContext, job: ImageTrainJob) -> _Trainer:
    speed = resolve_speed(job.speed, ctx.device, images=True)  # fails before any training
    size = job.model.image_size
    if speed.precision == "bf16" and ctx.device.type == "cpu" and size < MIN_CPU_BF16_IMAGE_SIZE:
        raise SpeedError(
            f"precision='bf16' with image_size={size} on CPU: oneDNN's bf16 convolutions "
            "corrupt the weights of a ResNet on images this small; pass image_size >= "
            f"{MIN_CPU_BF16_IMAGE_SIZE} or precision fp32 (auto)"
        )
    torch.manual_seed(job.seed)  # the same new head on every rank (DDP broadcasts it anyway)
    cfg = job.model
    weights = job.weights_uri or "none"
    model = build_resnet(cfg.arch, cfg.num_classes, weights, cfg.freeze_backbone).to(ctx.device)
    model = speed.apply_to_model(model)  # channels_last before DDP registers its buffers
    probe = torch.zeros(2, 3, size, size, dtype=torch.uint8), torch.zeros(2, dtype=torch.long)
    speed.check_runs(model, *probe)
    ddp_model = ctx.wrap(model)
    speed.compile_model(ddp_model)
    # Linear scaling: the global batch is batch_size * world_size, so is the step. A global
    # batch is the same on any world size: so is its learning rate.
    lr = job.lr if job.global_batch else job.lr * ctx.world_size
    optimizer = make_optimizer(
        job.optimizer, trainable_parameters(model), lr, fused=speed.fused_optimizer
    )
    # Stepped with the all-reduced validation loss, so every rank takes the same decision.
    scheduler = ReduceLROnPlateau(optimizer, mode="min", patience=job.lr_patience)
    return _Trainer(model, ddp_model, optimizer, scheduler, lr, speed)


def train_rank(
    ctx: TrainContext,
    job: ImageTrainJob,
    on_epoch_end: Callable[[EpochStats], None] | None = None,
) -> TrainResult:
    """Train, or resume exactly (the scheduler included) from the latest checkpoint.

    `on_epoch_end` (every rank, after the scheduler's step): an image sweep's searched trial
    waits there for the study's verdict (ddpflow.workloads.sweep.pruning)."""
    built = _build(ctx, job)
    optimizer, scheduler = built.optimizer, built.scheduler
    # A streamed split's batch that waits for its shard is still alive (the hang watch);
    # compressed shards are decoded on the rank's GPU, when it has one.
    train = open_split(job.train_uri, job.stream, on_wait=ctx.heartbeat, device=ctx.device)
    announce(built.speed, ctx)
    if job.augment:
        train = AugmentedSamples(train, job.seed)
    val = open_split(job.val_uri, job.stream, on_wait=ctx.heartbeat, device=ctx.device)
    extra = {"base_lr": job.lr, "lr": built.lr, "batch_size": job.batch_size, "seed": job.seed}

    def step_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        lr = optimizer.param_groups[0]["lr"]
        return {"train_accuracy": batch_accuracy(logits, targets), "lr": lr}

    hooks = FitHooks(
        evaluate=partial(
            _evaluate, split=val, ctx=ctx.rank_context, batch_size=job.eval_batch_size
        ),
        step_metrics=step_metrics,
        on_epoch_end=partial(_epoch_end, scheduler, on_epoch_end),
        speed=built.speed,
    )
    return fit_job(
        ctx,
        job,
        model=built.ddp_model,
        optimizer=optimizer,
        train=train,
        val=val,
        state={"scheduler": scheduler},
        info={"model_config": job.model.to_dict(), "extra": extra},
        hooks=hooks,
    )


def _epoch_end(
    scheduler: ReduceLROnPlateau,
    then: Callable[[EpochStats], None] | None,
    stats: EpochStats,
) -> None:
    scheduler.step(stats.val_loss)  # before a verdict that may stop the trial here
    if then is not None:
        then(stats)


def _evaluate(model: nn.Module, split: Samples, ctx: RankContext, batch_size: int) -> dict:
    if ctx.world_size > 1:
        # BatchNorm running statistics drift apart between ranks within an epoch (DDP copies
        # rank 0's at the start of each forward, then every rank updates them with its own
        # batch): validate rank 0's model, the one that is checkpointed, on every rank.
        for buffer in model.buffers():
            dist.broadcast(buffer.data, src=0)
    return evaluate_split(model, split, ctx, batch_size)
