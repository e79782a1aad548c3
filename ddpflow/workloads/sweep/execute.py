"""One trial's life: its child MLflow run, its job, its launch, and what became of it.

The launch itself is injected (`TrainFn`): the flow launches the trial's DDP group on its
Dask workers, the benchmark can also train in its own process. So is the job, for a workload
other than the pet-name model's (`SweepSetup.job`: the image sweep builds ImageTrainJobs).
Whatever fails, the child run ends FAILED with the error as a tag and the other trials
carry on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpflow import storage
from ddpflow.storage.redact import error_text, redact_text
from ddpflow.tracking.inspection import DatasetRef, log_datasets
from ddpflow.tracking.loggers import MlflowLogger, RunRef
from ddpflow.tracking.run import end_run, metric_history, start_run
from ddpflow.training.result import EpochStats, TrainResult
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.data import FormattedCorpus
from ddpflow.workloads.charlm.job import CharLMTrainJob
from ddpflow.workloads.sweep.config import (
    CHARLM_FIELDS,
    TrialConfig,
    TrialFields,
    TrialSpec,
)
from ddpflow.workloads.sweep.trial import TrialJob, elapsed_by_epoch

ERROR_TAG = "ddpflow.error"
FAILURE_KIND_TAG = "ddpflow.failure"  # "invalid" (never launched) or "crash"
WORKERS_TAG = "ddpflow.workers"  # the Dask workers a trial trained on
MAX_TAG_LEN = 5000
# The metrics fit() logs per epoch, in EpochStats' field order after `epoch`.
_EPOCH_METRICS = ("epoch_train_loss", "val_loss", "epoch_samples_per_s", "epoch_time_s")
TrainFn = Callable[[TrialJob, list[str]], TrainResult]
# A workload's job for one valid trial: (its config, the sweep's setup, its child run).
JobFn = Callable[[Any, "SweepSetup", RunRef], TrialJob]


@dataclass(frozen=True)
class SweepSetup:
    """What every trial of one sweep shares."""

    # The pet-name trials' data; None where `job` holds its workload's own (the images').
    corpus: FormattedCorpus | None
    parent: RunRef
    experiment: str
    artifact_root: str
    artifact_location: str | None
    keep_last: int
    params: Mapping[str, Any] = field(default_factory=dict)  # logged on every child run
    tags: Mapping[str, str] = field(default_factory=dict)
    datasets: Sequence[DatasetRef] = ()  # logged as every trained child run's inputs
    # What each rank asks of its worker (DDPFLOW_RANK_RESOURCES, e.g. {"GPU": 1}).
    rank_resources: Mapping[str, float] | None = None
    # The workload's trial fields and its job builder; unset: the pet-name model's.
    fields: TrialFields = CHARLM_FIELDS
    job: JobFn | None = None

    def trial_job(self, config: Any, run: RunRef) -> TrialJob:
        return (self.job or trial_job)(config, self, run)


@dataclass(frozen=True)
class TrialOutcome:
    spec: TrialSpec
    run_id: str
    completed: bool
    history: list[EpochStats] = field(default_factory=list)
    checkpoint_uri: str | None = None
    workers: list[str] = field(default_factory=list)
    error: str | None = None
    # A searched trial that the study stopped after this epoch (not completed, not failed).
    pruned_at: int | None = None

    @property
    def status(self) -> str:
        if self.pruned_at is not None:
            return "pruned"
        return "completed" if self.completed else "failed"

    @property
    def final_val_loss(self) -> float:
        return self.history[-1].val_loss if self.completed and self.history else math.nan

    @property
    def elapsed_s(self) -> float:
        elapsed = elapsed_by_epoch(self.history)
        return elapsed[-1][1] if elapsed else math.nan


def _start_child(spec: TrialSpec, setup: SweepSetup, workers: list[str] | None = None) -> RunRef:
    label = spec.config.label() if spec.config else "invalid"
    return start_run(
        setup.parent.tracking_uri,
        setup.experiment,
        run_name=f"{spec.name} {label}",
        # Only known fields: an unknown key may not even be a legal MLflow param name.
        params={**setup.params, **_known(spec), "trial": spec.index},
        tags={
            **setup.tags,
            "ddpflow.trial": str(spec.index),
            **({WORKERS_TAG: " ".join(workers)} if workers else {}),
        },
        artifact_location=setup.artifact_location,
        parent_run_id=setup.parent.run_id,
    )


def _known(spec: TrialSpec) -> dict[str, Any]:
    return {k: v for k, v in spec.values.items() if k in spec.field_names and v is not None}


def fail_run(run: RunRef, kind: str, error: str) -> None:
    """End `run` FAILED with why (`ddpflow.error`) and how (`ddpflow.failure`) as tags."""
    # Redacted before it is cut: a cut could leave "user:pass" without the "@" that marks it.
    shown = redact_text(error)[:MAX_TAG_LEN]
    MlflowLogger(run).set_tags({ERROR_TAG: shown, FAILURE_KIND_TAG: kind})
    end_run(run, failed=True)


def reject_trial(spec: TrialSpec, setup: SweepSetup) -> TrialOutcome:
    """An invalid trial is never launched; its child run records why, FAILED at once."""
    error = redact_text("invalid trial config: " + "; ".join(spec.errors))
    run = _start_child(spec, setup)
    fail_run(run, "invalid", error)
    return TrialOutcome(spec, run.run_id, completed=False, error=error)


def trial_job(config: TrialConfig, setup: SweepSetup, run: RunRef) -> CharLMTrainJob:
    """A pet-name trial's job (the default of SweepSetup.job)."""
    assert setup.corpus is not None, "a pet-name sweep's setup holds its corpus"
    return CharLMTrainJob(
        train_uri=setup.corpus.train_uri,
        val_uri=setup.corpus.val_uri,
        model=CharLSTMConfig(
            hidden_size=config.hidden_size, num_layers=config.num_layers, dropout=config.dropout
        ),
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        seed=config.seed,
        # Under the trial's own run id, like train-charlm: trials never share a folder.
        checkpoint_root=storage.join(setup.artifact_root, "runs", run.run_id, "checkpoints"),
        keep_last=setup.keep_last,
        run=run,
    )


def partial_history(run: RunRef) -> list[EpochStats]:
    """The epochs a crashed trial finished, read back from its run (for the plots)."""
    try:
        series = {k: dict(metric_history(run, k)) for k in _EPOCH_METRICS}
    except Exception:  # noqa: BLE001 - curves are a nicety; the failure is already recorded
        return []
    epochs = sorted(set.intersection(*(set(v) for v in series.values())))
    train_loss, val_loss, rate, took = (series[k] for k in _EPOCH_METRICS)
    return [EpochStats(e, train_loss[e], val_loss[e], rate[e], took[e]) for e in epochs]


def run_trial(
    spec: TrialSpec, workers: list[str], setup: SweepSetup, train: TrainFn
) -> TrialOutcome:
    """Train one valid trial on `workers`; a crash becomes a failed outcome, not an exception."""
    assert spec.config is not None, "invalid trials go to reject_trial"
    run = _start_child(spec, setup, workers)
    try:
        if setup.datasets:
            log_datasets(run, setup.datasets)
        result = train(setup.trial_job(spec.config, run), workers)
    except Exception as error:  # noqa: BLE001 - one trial's crash must not stop the sweep
        # Redacted once, here: it goes on to the tag, the sweep's table artifact and output.
        message = error_text(error)
        fail_run(run, "crash", message)
        return TrialOutcome(
            spec,
            run.run_id,
            completed=False,
            history=partial_history(run),
            workers=workers,
            error=message,
        )
    except BaseException:
        end_run(run, failed=True)  # interrupted: record it, then stop the sweep
        raise
    end_run(run)
    return TrialOutcome(
        spec,
        run.run_id,
        completed=True,
        history=list(result.history),
        checkpoint_uri=result.latest_checkpoint,
        workers=workers,
    )
