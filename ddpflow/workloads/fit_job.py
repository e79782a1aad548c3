"""What both built-in workloads do around ddpflow.fit: their job's common settings, the rank's
system metrics in the run, and the workload's result."""

from __future__ import annotations

from typing import Any, Protocol

from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.system_metrics import rank_system_metrics
from ddpflow.training.context import TrainContext
from ddpflow.training.fit import fit
from ddpflow.training.result import TrainResult


class WorkloadJob(Protocol):
    """The fields every built-in workload's job has (CharLMTrainJob, ImageTrainJob), read
    only (the jobs are frozen)."""

    @property
    def epochs(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def run(self) -> RunRef: ...
    @property
    def log_every_steps(self) -> int: ...
    @property
    def checkpoint_every_steps(self) -> int: ...
    @property
    def checkpoint_every_s(self) -> float: ...
    @property
    def global_batch(self) -> bool: ...


def fit_job(ctx: TrainContext, job: WorkloadJob, **fit_args: Any) -> TrainResult:
    """ddpflow.fit with the job's epochs, batch size, logging and checkpoint schedule, the
    rank's system metrics logged meanwhile; `fit_args` are the workload's own (model, data,
    state, info, hooks)."""
    with rank_system_metrics(job.run, ctx.rank):
        history = fit(
            ctx,
            epochs=job.epochs,
            batch_size=job.batch_size,
            log_every_steps=job.log_every_steps,
            checkpoint_every_steps=job.checkpoint_every_steps,
            checkpoint_every_s=job.checkpoint_every_s,
            global_batch=job.global_batch,
            **fit_args,
        )
    latest = ctx.latest_checkpoint if ctx.is_main else None
    return TrainResult(rank=ctx.rank, history=history, latest_checkpoint=latest)
