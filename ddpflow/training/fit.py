"""ddpflow.fit(): the built-in workloads' training loop, for any model, on a TrainContext.

What it adds to a hand-written loop over ctx.batches(): exact resume from inside an epoch
(checkpoints every N steps or every S seconds, and at every SIGTERM or retire_workers), torch's
RNG reseeded per step, windowed step metrics and per-epoch metrics in MLflow, and progress
events (log lines and step counts, for the flow's log and the Prefect progress artifact).
Both built-in workloads train through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ddpflow.checkpoint.steps import DEFAULT_CHECKPOINT_EVERY_S, CheckpointSchedule, EpochPosition
from ddpflow.checkpoint.store import Stateful
from ddpflow.training.batching import check_global_batch_fits
from ddpflow.training.context import TrainContext
from ddpflow.training.loop import FitHooks, FitPlan, fit_loop
from ddpflow.training.result import EpochStats
from ddpflow.training.samples import Samples

Info = Mapping[str, Any] | Callable[[int, EpochPosition | None], Mapping[str, Any]]


def fit(
    ctx: TrainContext,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train: Samples,
    val: Samples,
    epochs: int,
    batch_size: int,
    state: Mapping[str, Stateful] | None = None,
    info: Info | None = None,
    hooks: FitHooks | None = None,
    log_every_steps: int = 20,
    eval_batch_size: int = 8192,
    checkpoint_every_steps: int = 0,
    checkpoint_every_s: float = DEFAULT_CHECKPOINT_EVERY_S,
    global_batch: bool = False,
) -> list[EpochStats]:
    """Train `model` (already in DistributedDataParallel: ctx.wrap) for `epochs` epochs.

    Call on every rank. `model(inputs, targets)` returns (outputs, loss), or give
    `hooks=FitHooks(loss=...)` and `model(inputs)` returns outputs. Each rank takes
    `batch_size` samples of `train` per step (ddpflow.training.samples: `len` and
    `batch(index)`) and validates on its shard of `val`. With `global_batch=True`,
    `batch_size` is the whole group's batch per step instead, dealt out among the ranks: the
    steps and their gradients are those of any world size (up to floating-point reduction
    order), so a group that grows or shrinks trains the same model.

    With a checkpoint folder (ddpflow.run's checkpoint_dir), it first resumes from the latest
    checkpoint, then saves the model, the optimizer, each object of `state` (a scheduler...)
    and the speed settings' GradScaler, with `info` (plain values, or a function of the epochs
    done and the position inside the next epoch) at every epoch's end and as scheduled inside
    epochs. Without one, it trains from scratch and checkpoints nothing.

    Returns the stats of every epoch of the training, those trained before a restart included:
    each checkpoint carries the epochs done so far (its `fit_history` info value).
    """
    hooks = hooks or FitHooks()
    check_fit(ctx, model, epochs, batch_size, log_every_steps, state)
    check_global_batch(global_batch, batch_size, ctx.world_size)
    objects: dict[str, Stateful] = {"model": model, "optimizer": optimizer, **(state or {})}
    if hooks.speed is not None:
        objects["scaler"] = hooks.speed
    start_epoch, position, saved = ctx.resume_checkpoint(**objects)
    # The epochs before a restart: the relaunched call returns them too.
    history = [EpochStats(**stats) for stats in saved.get(HISTORY_INFO, [])]

    def save_checkpoint(epochs_done: int, position: EpochPosition | None = None) -> None:
        if not ctx.can_checkpoint:
            return  # no checkpoint folder: the training is not resumable, by choice
        values = dict((info(epochs_done, position) if callable(info) else info) or {})
        if HISTORY_INFO in values:
            raise ValueError(f"fit(info=...) names {HISTORY_INFO!r}, which fit keeps: rename it")
        values[HISTORY_INFO] = [asdict(stats) for stats in history]
        ctx.write_checkpoint(epochs_done, objects, position=position, info=values)

    plan = FitPlan(
        epochs=epochs,
        batch_size=batch_size,
        seed=ctx.seed,
        start_epoch=start_epoch,
        log_every_steps=log_every_steps,
        eval_batch_size=eval_batch_size,
        checkpoints=CheckpointSchedule(checkpoint_every_steps, checkpoint_every_s, log_every_steps),
        resume_at=position,
        global_batch=global_batch,
    )
    return fit_loop(
        model=model,
        optimizer=optimizer,
        train=train,
        val=val,
        ctx=ctx.rank_context,
        logger=ctx.metric_logger,
        save_checkpoint=save_checkpoint,
        plan=plan,
        hooks=hooks,
        history=history,
    )


OWN_NAMES = ("model", "optimizer", "scaler")
HISTORY_INFO = "fit_history"  # the checkpoint's info value with the epochs' stats so far


def check_global_batch(global_batch: object, batch_size: object, world_size: int) -> None:
    if not isinstance(global_batch, bool):
        raise ValueError(f"fit(global_batch={global_batch!r}) must be True or False")
    if global_batch and isinstance(batch_size, int):
        check_global_batch_fits(batch_size, world_size)


def check_fit(
    ctx: TrainContext,
    model: nn.Module,
    epochs: object,
    batch_size: object,
    log_every_steps: object,
    state: Mapping[str, Stateful] | None,
) -> None:
    """Bad input fails before any checkpoint is read, naming the input and the fix."""
    for name, value in (
        ("epochs", epochs),
        ("batch_size", batch_size),
        ("log_every_steps", log_every_steps),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fit({name}={value!r}): {name} must be an int >= 1")
    if ctx.world_size > 1 and not isinstance(model, nn.parallel.DistributedDataParallel):
        # Without DDP every rank would train its own copy: the gradients are never averaged.
        raise ValueError(
            f"fit(model=...) got a {type(model).__name__} on {ctx.world_size} ranks: wrap it "
            "in DistributedDataParallel first, model=ctx.wrap(net)"
        )
    clashes = sorted(set(state or {}) & set(OWN_NAMES))
    if clashes:
        raise ValueError(
            f"fit(state=...) names {clashes}, which fit checkpoints itself: rename them "
            f"(not {list(OWN_NAMES)})"
        )
