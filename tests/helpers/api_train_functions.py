"""Training functions the public-API tests run through ddpflow.run(): here, in a module of
their own, so the Dask worker processes import them by name (the test module imports pytest
fixtures the workers do not need)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

import ddpflow
from examples import digits, digits_fit, regression_mlp

KILL_AFTER_CHECKPOINT = 2


class _ReportsPidAfterCheckpoint:
    """A TrainContext that, on rank 1 right after checkpoint KILL_AFTER_CHECKPOINT, reports
    "pid N" and waits to be killed. The wait makes the kill land mid-run on a training
    whose epochs take a fraction of a second; the test's on_progress sends the SIGKILL.
    Rank 0 also sends each checkpoint's epoch as step counts (ctx.send_progress), as a loop
    of one's own may, for run_in_flow's progress artifact."""

    def __init__(self, ctx: ddpflow.TrainContext, epochs: int):
        self._ctx, self._epochs = ctx, epochs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def save_checkpoint(self, step: int, **objects: Any) -> None:
        self._ctx.save_checkpoint(step, **objects)
        if self._ctx.is_main:
            self._ctx.send_progress(
                ddpflow.Progress(
                    step=step, total_steps=self._epochs, epoch=step, epochs=self._epochs
                )
            )
        if self._ctx.rank == 1 and step == KILL_AFTER_CHECKPOINT:
            self._ctx.report(f"pid {os.getpid()}")
            # Heartbeats keep the group's watchdog quiet while the kill is on its way; a
            # relaunch resumes after this checkpoint, so it never waits here again.
            for _ in range(600):
                self._ctx.heartbeat()
                time.sleep(0.1)
            raise RuntimeError("rank 1 was not killed within 60 s")


class KillReportedPid:
    """An on_progress callback: SIGKILLs the first "pid N" a rank reports, once."""

    def __init__(self) -> None:
        self.killed: list[int] = []

    def __call__(self, line: str) -> None:
        found = re.fullmatch(r"pid (\d+)", line)
        if found and not self.killed:
            self.killed.append(int(found.group(1)))
            os.kill(self.killed[0], signal.SIGKILL)


def digits_killed_after_checkpoint(ctx: ddpflow.TrainContext, epochs: int) -> float:
    """The example's training, with rank 1 offered up for a SIGKILL after checkpoint 2."""
    return digits.train(_ReportsPidAfterCheckpoint(ctx, epochs), epochs)


def resumes_model_only(ctx: ddpflow.TrainContext) -> int:
    """Resumes a digits checkpoint (model, optimizer, scheduler) naming only the model."""
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    return ctx.resume(model=net)


def touches_marker(ctx: ddpflow.TrainContext, marker: str) -> None:
    """Leaves a file behind if it ever runs: pre-flight errors must come before this."""
    with open(f"{marker}.{ctx.rank}", "w") as file:
        file.write("ran")


def holds_a_lock() -> Any:
    """A closure over a lock: it cannot travel to a worker process."""
    lock = threading.Lock()

    def train(ctx: ddpflow.TrainContext) -> None:
        with lock:
            torch.zeros(1)

    return train


def logs_three_points(ctx: ddpflow.TrainContext) -> str:
    """Three metric points from rank 0; nothing else."""
    for step in (1, 2, 3):
        ctx.log_metrics({"x": float(step)}, step=step)
    return "trained"


# A global step inside epoch 2 of examples/digits_fit (21-22 steps an epoch on 2 ranks),
# after that epoch's checkpoint at step 10 and before the one at step 20.
KILL_AT_GLOBAL_STEP = 36


class _StepsReportPid:
    """The launcher's rank context of rank 1, reporting "pid N" at KILL_AT_GLOBAL_STEP and
    waiting there to be killed; everything else is the real context."""

    def __init__(self, rank_ctx: Any):
        self._rank_ctx = rank_ctx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rank_ctx, name)

    def heartbeat(self, step: int | None = None) -> None:
        self._rank_ctx.heartbeat(step)
        if step == KILL_AT_GLOBAL_STEP:
            self._rank_ctx.report(f"pid {os.getpid()}")
            for _ in range(600):
                self._rank_ctx.heartbeat()
                time.sleep(0.1)
            raise RuntimeError("rank 1 was not killed within 60 s")


class _KilledMidEpoch:
    """A TrainContext whose rank 1 is offered up for a SIGKILL inside an epoch, on a fresh
    start only: the relaunch resumes from the checkpoint inside that epoch and goes on."""

    def __init__(self, ctx: ddpflow.TrainContext):
        self._ctx = ctx
        self._armed = ctx.rank == 1 and ctx.latest_checkpoint is None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    @property
    def rank_context(self) -> Any:
        real = self._ctx.rank_context
        return _StepsReportPid(real) if self._armed else real


def digits_fit_killed_mid_epoch(ctx: ddpflow.TrainContext, epochs: int) -> float:
    """examples/digits_fit's training, with rank 1 killed inside epoch 2."""
    return digits_fit.train(_KilledMidEpoch(ctx), epochs)


def regression_killed_mid_epoch(ctx: ddpflow.TrainContext, epochs: int) -> list[float]:
    """examples/regression_mlp's training, with rank 1 killed inside epoch 2."""
    return regression_mlp.train(_KilledMidEpoch(ctx), epochs)


def where_each_rank_runs(ctx: ddpflow.TrainContext) -> list[tuple[int, str | None, int]]:
    """Every rank's (rank, worker address, pid), gathered to each rank."""
    gathered: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, (ctx.rank, ctx.worker_address, ctx.pid))
    return gathered
