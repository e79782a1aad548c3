"""The rank entry point for the pet-name model: build objects from a job, then ddpflow.fit().

It is a training function of the public API, `train_rank(ctx, job)` on a TrainContext,
launched the way ddpflow.run() launches a user's (ddpflow.api.rank_entry).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddpflow.checkpoint.steps import EpochPosition
from ddpflow.training.context import TrainContext
from ddpflow.training.loop import FitHooks
from ddpflow.training.result import EpochStats, TrainResult
from ddpflow.training.speed.device import announce, resolve_speed
from ddpflow.workloads.charlm.data import open_windows
from ddpflow.workloads.charlm.job import CharLMTrainJob
from ddpflow.workloads.charlm.model import CharLSTM
from ddpflow.workloads.charlm.vocab import CONTEXT_LEN
from ddpflow.workloads.fit_job import fit_job


def train_rank(
    ctx: TrainContext,
    job: CharLMTrainJob,
    on_epoch_end: Callable[[EpochStats], None] | None = None,
) -> TrainResult:
    """Train, or resume from the latest complete checkpoint after a restart.

    `on_epoch_end` (every rank, after the epoch's metrics are logged, before its checkpoint):
    a sweep's searched trial waits there for the study's verdict (ddpflow.workloads.sweep.pruning).

    Resuming is exact, from an epoch's end or from inside an epoch: the data order is a
    function of (seed, epoch, world size) and fit() reseeds the dropout RNG from (seed, rank,
    epoch, step) before every step, so weights, optimizer state and the position (epoch,
    steps done, the epoch's partial loss sums) are all a checkpoint needs.
    """
    speed = resolve_speed(job.speed, ctx.device)  # a setting this device cannot run fails here
    torch.manual_seed(job.seed)  # same initial weights on every rank
    model = speed.apply_to_model(CharLSTM(job.model).to(ctx.device))
    probe = torch.zeros(2, CONTEXT_LEN, dtype=torch.uint8)
    speed.check_runs(model, probe, probe)  # before any checkpoint is read or written
    optimizer = torch.optim.Adam(model.parameters(), lr=job.lr, fused=speed.fused_optimizer or None)
    ddp_model = ctx.wrap(model)
    speed.compile_model(ddp_model)
    announce(speed, ctx)

    def info(epochs_done: int, position: EpochPosition | None) -> dict:
        # Where training stands: epoch `epochs_done` (0-based) goes on at this step, in the
        # order epoch_batches(seed, epoch, rank, world_size); RNG is reseeded per step.
        # "position" (inside an epoch only) has the rest.
        extra = {
            "lr": job.lr,
            "batch_size": job.batch_size,
            "seed": job.seed,
            "step_in_epoch": position.step if position else 0,
            "data_order": {
                "seed": job.seed,
                "next_epoch": epochs_done,
                "world_size": ctx.world_size,
            },
        }
        return {"model_config": job.model.to_dict(), "extra": extra}

    return fit_job(
        ctx,
        job,
        model=ddp_model,
        optimizer=optimizer,
        # A streamed split's batch that waits for its shard is still alive (the hang watch).
        train=open_windows(job.train_uri, on_wait=ctx.heartbeat),
        val=open_windows(job.val_uri, on_wait=ctx.heartbeat),
        info=info,
        hooks=FitHooks(speed=speed, on_epoch_end=on_epoch_end),
    )
