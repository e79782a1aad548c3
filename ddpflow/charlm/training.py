"""The rank entry point for the pet-name model: build objects from a job, then call fit()."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpflow.charlm.data import load_windows
from ddpflow.charlm.formatting import split_xy
from ddpflow.charlm.model import CharLSTM, CharLSTMConfig
from ddpflow.charlm.vocab import CONTEXT_LEN
from ddpflow.checkpoint import CheckpointStore, build_state, resume_position, write_checkpoint
from ddpflow.distributed.context import RankContext
from ddpflow.samples import TensorSamples
from ddpflow.speed import PLAIN, SpeedSettings, announce
from ddpflow.step_checkpoints import DEFAULT_CHECKPOINT_EVERY_S, CheckpointSchedule, EpochPosition
from ddpflow.system_metrics import rank_system_metrics
from ddpflow.tracking import RunRef, close_logger, logger_for_rank, spool_folder
from ddpflow.train_loop import FitHooks, FitPlan, TrainResult, fit
from ddpflow.training_progress import progress_topic


@dataclass(frozen=True)
class CharLMTrainJob:
    """Everything a rank needs, as URIs and numbers (it crosses the network to each worker)."""

    train_uri: str
    val_uri: str
    model: CharLSTMConfig
    epochs: int
    batch_size: int
    lr: float
    seed: int
    checkpoint_root: str
    keep_last: int
    run: RunRef
    log_every_steps: int = 20
    speed: SpeedSettings = PLAIN
    # Checkpoints inside an epoch (ddpflow.step_checkpoints); 0 turns a trigger off.
    checkpoint_every_steps: int = 0
    checkpoint_every_s: float = DEFAULT_CHECKPOINT_EVERY_S


def train_rank(ctx: RankContext, job: CharLMTrainJob) -> TrainResult:
    """Train, or resume from the latest complete checkpoint after a restart.

    Resuming is exact, from an epoch's end or from inside an epoch: the data order is a
    function of (seed, epoch, world size) and fit() reseeds the dropout RNG from (seed, rank,
    epoch, step) before every step, so weights, optimizer state and the position (epoch,
    steps done, the epoch's partial loss sums) are all a checkpoint needs.
    """
    speed = job.speed.resolve(ctx.device)  # a setting this device cannot run fails here
    torch.manual_seed(job.seed)  # same initial weights on every rank
    model = speed.apply_to_model(CharLSTM(job.model).to(ctx.device))
    probe = torch.zeros(2, CONTEXT_LEN, dtype=torch.uint8)
    speed.check_runs(model, probe, probe)  # before any checkpoint is read or written
    optimizer = torch.optim.Adam(model.parameters(), lr=job.lr)
    store = CheckpointStore(job.checkpoint_root, job.keep_last)
    start_epoch, position, _ = resume_position(store, model, optimizer, speed)
    ddp_model = DistributedDataParallel(
        model, device_ids=[0] if ctx.device.type == "cuda" else None
    )
    speed.compile_model(ddp_model)
    logger = logger_for_rank(
        ctx.is_main, job.run, spool_folder(job.checkpoint_root, job.run.run_id)
    )
    announce(speed, ctx, logger)

    def save_checkpoint(epoch: int, position: EpochPosition | None = None) -> None:
        state = build_state(
            model,
            optimizer,
            epoch,
            job.model.to_dict(),
            extra={
                "lr": job.lr,
                "batch_size": job.batch_size,
                "seed": job.seed,
                # Where training stands: epoch `epoch` (0-based) goes on at this step, in
                # the order epoch_batches(seed, epoch, rank, world_size); RNG is reseeded
                # per step. "position" (inside an epoch only) has the rest.
                "step_in_epoch": position.step if position else 0,
                "data_order": {"seed": job.seed, "next_epoch": epoch, "world_size": ctx.world_size},
            },
            speed=speed,
        )
        write_checkpoint(store, logger, epoch, state, position)

    with rank_system_metrics(job.run, ctx.rank):
        history = fit(
            model=ddp_model,
            optimizer=optimizer,
            train=TensorSamples(load_windows(job.train_uri), split_xy),
            val=TensorSamples(load_windows(job.val_uri), split_xy),
            ctx=ctx,
            logger=logger,
            save_checkpoint=save_checkpoint,
            plan=FitPlan(
                epochs=job.epochs,
                batch_size=job.batch_size,
                seed=job.seed,
                start_epoch=start_epoch,
                log_every_steps=job.log_every_steps,
                progress_topic=progress_topic(job.run.run_id),
                checkpoints=CheckpointSchedule(
                    job.checkpoint_every_steps, job.checkpoint_every_s, job.log_every_steps
                ),
                resume_at=position,
            ),
            hooks=FitHooks(speed=speed),
        )
    # Everything logged is in MLflow before the flow reads it, or listed in `unsent`.
    unsent = close_logger(logger, ctx.heartbeat)
    latest = store.latest_uri() if ctx.is_main else None
    return TrainResult(
        rank=ctx.rank, history=history, latest_checkpoint=latest, unsent=tuple(unsent)
    )
