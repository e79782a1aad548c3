"""MLflow: the flow creates one run; rank 0 logs into it by run_id, other ranks log nothing.

MLflow's "active run" is thread-local and Dask runs code in other threads and processes,
so every call here names the tracking URI and run id explicitly (MlflowClient).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

# Opens the experiment in the MLflow UI's "Model training" view (metric charts) instead of
# the GenAI view that MLflow 3.17 picks for experiments without a kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN = 6000
PARENT_RUN_TAG = "mlflow.parentRunId"


@dataclass(frozen=True)
class RunRef:
    """Where to log: small and picklable, handed to every rank."""

    tracking_uri: str
    run_id: str


class MetricLogger(Protocol):
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: Mapping[str, str]) -> None: ...


class NullLogger:
    """What every rank but 0 gets: the training loop never branches on rank to log."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass


class MlflowLogger:
    def __init__(self, run: RunRef):
        self.run = run
        self.client = MlflowClient(run.tracking_uri)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        batch = [Metric(k, float(v), now_ms, step) for k, v in metrics.items()]
        self.client.log_batch(self.run.run_id, metrics=batch)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run.run_id, local_path, artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.client.log_batch(self.run.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def logger_for_rank(is_main: bool, run: RunRef) -> MetricLogger:
    """Rank-0 gating, declared once: rank 0 logs to MLflow, the others log nowhere."""
    return MlflowLogger(run) if is_main else NullLogger()


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        experiment_id = client.create_experiment(name, artifact_location=artifact_location)
    else:
        experiment_id = experiment.experiment_id
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment_id


def default_artifact_location(tracking_uri: str, project_dir: Path) -> str | None:
    """With a SQLite store, keep MLflow's artifacts in the project folder, not the cwd.

    A tracking server decides its own artifact destination, so it gets None.
    """
    if tracking_uri.startswith("sqlite:"):
        return (project_dir / "mlartifacts").as_uri()
    return None


def start_run(
    tracking_uri: str,
    experiment_name: str,
    run_name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str],
    artifact_location: str | None = None,
    parent_run_id: str | None = None,
) -> RunRef:
    """Create the one MLflow run of a training and log its parameters and tags.

    With `parent_run_id` the run is a child (e.g. a sweep's trial): the MLflow UI nests it
    under its parent through the `mlflow.parentRunId` tag.
    """
    client = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(client, experiment_name, artifact_location)
    tags = {**tags, PARENT_RUN_TAG: parent_run_id} if parent_run_id else dict(tags)
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    param_batch = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
    client.log_batch(run.info.run_id, params=param_batch)
    return RunRef(tracking_uri, run.info.run_id)


def log_restart(run: RunRef, attempt: int, cause: str) -> None:
    """Count restarts on the training's one run (its metrics simply continue afterwards)."""
    client = MlflowClient(run.tracking_uri)
    client.set_tag(run.run_id, "ddpflow.restarts", str(attempt))
    client.set_tag(run.run_id, f"ddpflow.restart.{attempt}.cause", cause[:MAX_PARAM_LEN])
    client.log_metric(run.run_id, "restarts", attempt, step=attempt)


def end_run(run: RunRef, failed: bool = False) -> None:
    MlflowClient(run.tracking_uri).set_terminated(run.run_id, "FAILED" if failed else "FINISHED")


def metric_history(run: RunRef, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, in step order."""
    history = MlflowClient(run.tracking_uri).get_metric_history(run.run_id, key)
    return sorted((m.step, m.value) for m in history)
