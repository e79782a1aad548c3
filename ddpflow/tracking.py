"""MLflow: the flow creates one run; rank 0 logs into it by run_id, the other ranks only
their system metrics (ddpflow.system_metrics).

MLflow's "active run" is thread-local and Dask runs code in other threads and processes,
so every call here names the tracking URI and run id explicitly (MlflowClient).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlflow
import numpy as np
import torch
from mlflow.entities import Metric, Param, RunTag
from mlflow.models import infer_signature
from mlflow.tracking import MlflowClient

from ddpflow.bounded import call_bounded
from ddpflow.mlflow_pytorch import mlflow_pytorch
from ddpflow.redact import redact_text, redact_url
from ddpflow.sqlite_store import prepare_sqlite_store

log = logging.getLogger(__name__)
# Opens the experiment in the MLflow UI's "Model training" view (metric charts) instead of
# the GenAI view that MLflow 3.17 picks for experiments without a kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN = 6000
# MLflow's client retries a dead or failing server for about 5 minutes.
END_RUN_TIMEOUT_S = 15.0
PARENT_RUN_TAG = "mlflow.parentRunId"


@dataclass(frozen=True)
class RunRef:
    """Where to log: small and picklable, handed to every rank."""

    tracking_uri: str
    run_id: str


# The longest rank 0 waits at a checkpoint for MLflow to take the epoch's metrics.
FLUSH_TIMEOUT_S = 10.0


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


class BackgroundMlflowLogger:
    """An MlflowLogger whose calls run on a background thread, in order.

    Rank 0 never waits for MLflow: a slow or dead server would otherwise stall rank 0, and
    with it every other rank at the next collective (MLflow's client retries a failing server
    for minutes). A call that fails is reported and dropped; training goes on. `close()`
    waits a bounded time for what is queued.

    A restarted attempt re-runs the steps after its checkpoint that an earlier attempt
    already logged. Those (key, step) points are skipped, so every metric has each step
    once: resume is exact, so the earlier attempt logged the same loss. What was logged
    before is read from MLflow the first time each key is logged (on this thread).
    """

    def __init__(self, run: RunRef, close_timeout_s: float = 60.0):
        self._logger = MlflowLogger(run)
        self._close_timeout_s = close_timeout_s
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._logged_before: dict[str, int] = {}  # key -> last step an earlier attempt logged
        self._spool = tempfile.mkdtemp(prefix="ddpflow-mlflow-")
        self._thread = threading.Thread(target=self._drain, name="mlflow-logger", daemon=True)
        self._thread.start()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)  # stamped now, not when the thread gets to it
        batch = [Metric(k, float(v), now_ms, step) for k, v in metrics.items()]
        self._queue.put(lambda: self._log_new(batch))

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        # The caller may delete its file as soon as we return: upload a copy of our own.
        copy = os.path.join(self._spool, uuid.uuid4().hex, os.path.basename(local_path))
        os.makedirs(os.path.dirname(copy))
        shutil.copyfile(local_path, copy)

        def upload() -> None:
            try:
                self._logger.log_artifact(copy, artifact_path)
            finally:
                shutil.rmtree(os.path.dirname(copy), ignore_errors=True)

        self._queue.put(upload)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        tags = dict(tags)
        self._queue.put(lambda: self._logger.set_tags(tags))

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every call queued so far; True when they are done.

        Called before each checkpoint: a resume starts after the checkpoint and never logs
        its epochs again, so their metrics must be in MLflow before it exists. Without this,
        a worker that died right after a checkpoint lost the epoch's queued metrics.
        """
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "MLflow did not take the last %d logging calls within %.0fs; they are dropped",
                self._queue.qsize(),
                self._close_timeout_s,
            )
        shutil.rmtree(self._spool, ignore_errors=True)

    def _log_new(self, batch: list[Metric]) -> None:
        new = [m for m in batch if m.step > self._last_step_logged_before(m.key)]
        if new:
            self._logger.client.log_batch(self._logger.run.run_id, metrics=new)

    def _last_step_logged_before(self, key: str) -> int:
        if key not in self._logged_before:
            history = self._logger.client.get_metric_history(self._logger.run.run_id, key)
            self._logged_before[key] = max((m.step for m in history), default=-1)
        return self._logged_before[key]

    def _drain(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                call()
            except Exception as error:  # noqa: BLE001 - logging must never stop training
                log.warning("MLflow logging call failed and was dropped: %s", error)


def logger_for_rank(is_main: bool, run: RunRef) -> MetricLogger:
    """Rank-0 gating, declared once: rank 0 logs to MLflow, the others log nowhere."""
    return BackgroundMlflowLogger(run) if is_main else NullLogger()


def flush_logger(logger: MetricLogger, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Wait (bounded) until a buffering logger has sent what it holds; a no-op for the
    others. A slow or dead server costs at most `timeout_s`, with a warning."""
    flush = getattr(logger, "flush", None)
    if flush is not None and not flush(timeout_s):
        log.warning(
            "MLflow did not take this epoch's logging calls within %.0fs; the checkpoint is "
            "written anyway, and the calls are still sent while training goes on",
            timeout_s,
        )


def close_logger(logger: MetricLogger) -> None:
    """Flush a logger that buffers (bounded); a no-op for the others."""
    close = getattr(logger, "close", None)
    if close is not None:
        close()


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
    prepare_sqlite_store(tracking_uri)  # the first run on a fresh file creates its schema
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


def register_pt2_model(
    run: RunRef,
    serving: torch.nn.Module,
    example: np.ndarray,
    registered_name: str,
    quiet_warnings: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Log `serving` to the run in torch.export format with a signature, register it.

    pt2 rather than pickle: loading it needs torch, not ddpflow's classes. Explicit pip
    requirements skip MLflow's slow dependency inference. `quiet_warnings` are
    `warnings.filterwarnings` arguments for export notes known to be harmless.
    """
    with torch.no_grad():
        signature = infer_signature(example, serving(torch.from_numpy(example)).numpy())
    mlflow.set_tracking_uri(run.tracking_uri)
    with mlflow.start_run(run_id=run.run_id), warnings.catch_warnings():
        for quiet in quiet_warnings:
            warnings.filterwarnings("ignore", **quiet)
        info = mlflow_pytorch.log_model(
            serving,
            name="model",
            signature=signature,
            input_example=example,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            serialization_format="pt2",
            registered_model_name=registered_name,
        )
    return str(info.registered_model_version)


def end_run(run: RunRef, failed: bool = False, timeout_s: float = END_RUN_TIMEOUT_S) -> None:
    """Mark the run FINISHED or FAILED, waiting at most `timeout_s` for MLflow.

    A run is marked FAILED on the way out of an error the caller re-raises, so that never
    raises: with MLflow down it logs a warning and the original error comes through. A run
    that finished but cannot be marked so raises (TimeoutError or MLflow's error).
    """
    status = "FAILED" if failed else "FINISHED"
    client = MlflowClient(run.tracking_uri)
    what = f"marking MLflow run {run.run_id} {status} at {redact_url(run.tracking_uri)}"
    try:
        call_bounded(lambda: client.set_terminated(run.run_id, status), timeout_s, what)
    except Exception as error:
        if not failed:
            raise
        log.warning("%s failed, the run stays RUNNING: %s", what, redact_text(str(error)))


def metric_history(run: RunRef, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, in step order."""
    history = MlflowClient(run.tracking_uri).get_metric_history(run.run_id, key)
    return sorted((m.step, m.value) for m in history)


def log_files(run: RunRef, files: Mapping[str, bytes], folder: str) -> None:
    """Log in-memory files (plots, tables) as artifacts of `run` under `folder`."""
    logger = MlflowLogger(run)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            path = os.path.join(tmp, name)
            Path(path).write_bytes(data)
            logger.log_artifact(path, folder)
