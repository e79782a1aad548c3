"""What one trial runs on its ranks: its workload's training plus the sweep's own metrics.

A trial's job says its workload: a CharLMTrainJob trains a pet-name model, an ImageTrainJob
an image classifier; `train_rank_of` finds that workload's rank function on the rank.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from ddpflow.training.result import EpochStats, TrainResult
from ddpflow.workloads.charlm.job import CharLMTrainJob
from ddpflow.workloads.vision.job import ImageTrainJob

if TYPE_CHECKING:
    from ddpflow.training.context import TrainContext

ELAPSED_METRIC = "elapsed_s"
FINAL_VAL_LOSS_METRIC = "final_val_loss"
TrialJob = CharLMTrainJob | ImageTrainJob


def workload_of(job: TrialJob) -> str:
    """The workload's name in the trial's Prefect keys: charlm or images."""
    return "images" if isinstance(job, ImageTrainJob) else "charlm"


def train_rank_of(job: TrialJob) -> Callable[..., TrainResult]:
    """The workload's `train_rank(ctx, job, on_epoch_end=None)`, imported on the rank (the
    flow process imports this module without torch), looked up when called: a worker
    preload may have wrapped it."""
    module: Any
    if isinstance(job, ImageTrainJob):
        import ddpflow.workloads.vision.training as module
    else:
        import ddpflow.workloads.charlm.training as module
    return module.train_rank


def elapsed_by_epoch(history: Sequence[EpochStats]) -> list[tuple[int, float]]:
    """(epoch, training seconds since the trial started): the tutorial's `elapsed_time_sec`.

    It sums the epochs' training time, so validation and checkpoint writes (the same cost
    for every trial of a model size) do not blur the comparison of batch sizes and rates.
    """
    totals = itertools.accumulate(s.epoch_time_s for s in history)
    return [(s.epoch, total) for s, total in zip(history, totals, strict=True)]


def trial_rank(ctx: TrainContext, job: TrialJob) -> TrainResult:
    """One rank of a trial: train, then (rank 0) log elapsed seconds and the final loss."""
    result = train_rank_of(job)(ctx, job)
    if ctx.is_main:
        _log_trial_metrics(job, result.history)
    return result


def _log_trial_metrics(job: TrialJob, history: Sequence[EpochStats]) -> None:
    now_ms = int(time.time() * 1000)
    metrics = [Metric(ELAPSED_METRIC, s, now_ms, epoch) for epoch, s in elapsed_by_epoch(history)]
    if history:
        # The last epoch's holdout loss (full holdout, eval mode): what trials are ranked by.
        last = history[-1]
        metrics.append(Metric(FINAL_VAL_LOSS_METRIC, last.val_loss, now_ms, last.epoch))
    if metrics:
        MlflowClient(job.run.tracking_uri).log_batch(job.run.run_id, metrics=metrics)
