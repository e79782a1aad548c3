"""MLflow: the flow creates one run; rank 0 logs into it by run_id, the other ranks only
their system metrics (ddpflow.system_metrics).

MLflow's "active run" is thread-local and Dask runs code in other threads and processes,
so every call here names the tracking URI and run id explicitly (MlflowClient).
"""

from __future__ import annotations

import logging
import os
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
from ddpflow.tracking_spool import (
    FLUSH_TIMEOUT_ENV,
    Entry,
    Spool,
    Unsent,
    flush_timeout_s,
    spool_max_bytes,
)

log = logging.getLogger(__name__)
# Opens the experiment in the MLflow UI's "Model training" view (metric charts) instead of
# the GenAI view that MLflow 3.17 picks for experiments without a kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN = 6000
# MLflow's client retries a dead or failing server for about 5 minutes.
END_RUN_TIMEOUT_S = 15.0
PARENT_RUN_TAG = "mlflow.parentRunId"
# On a run that lacks logging calls MLflow never took (ddpflow.tracking_spool).
TRACKING_INCOMPLETE_TAG = "ddpflow.tracking_incomplete"


@dataclass(frozen=True)
class RunRef:
    """Where to log: small and picklable, handed to every rank."""

    tracking_uri: str
    run_id: str


class MetricLogger(Protocol):
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(
        self, local_path: str, artifact_path: str | None = None, origin: str | None = None
    ) -> None: ...

    def set_tags(self, tags: Mapping[str, str]) -> None: ...


class NullLogger:
    """What every rank but 0 gets: the training loop never branches on rank to log."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(
        self, local_path: str, artifact_path: str | None = None, origin: str | None = None
    ) -> None:
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

    def log_artifact(
        self, local_path: str, artifact_path: str | None = None, origin: str | None = None
    ) -> None:
        self.client.log_artifact(self.run.run_id, local_path, artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.client.log_batch(self.run.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


class BackgroundMlflowLogger:
    """An MlflowLogger whose calls wait on disk and are sent by a background thread, in order.

    Rank 0 never waits for MLflow: a slow or dead server would otherwise stall rank 0, and
    with it every other rank at the next collective (MLflow's client retries a failing server
    for minutes). Each call is first written to a bounded folder (ddpflow.tracking_spool), so
    an outage only delays it: a call that fails is retried, the oldest first, until MLflow
    takes it. `close()` waits a bounded time for what waits and returns what MLflow still
    lacks then.

    Each metric step ends up in MLflow once. A restarted attempt re-runs the steps after its
    checkpoint that an earlier attempt already logged, and a call retried after an outage may
    have reached MLflow before its answer was lost: points at or below the last step MLflow
    holds for their key are skipped. That step is read from MLflow the first time a key is
    logged and again after each failed call (on this thread). Resume is exact, so the earlier
    attempt logged the same values.
    """

    def __init__(
        self,
        run: RunRef,
        spool_dir: str | Path | None = None,
        close_timeout_s: float | None = None,
        max_spool_bytes: int | None = None,
        retry_max_s: float = 10.0,
    ):
        self._logger = MlflowLogger(run)
        self._close_timeout_s = flush_timeout_s() if close_timeout_s is None else close_timeout_s
        folder = Path(spool_dir) if spool_dir else Path(tempfile.mkdtemp(prefix="ddpflow-spool-"))
        self.spool = Spool(folder, max_spool_bytes or spool_max_bytes())
        self._retry_max_s = retry_max_s
        self._logged_before: dict[str, int] = {}  # key -> last step MLflow holds
        self._wake = threading.Event()  # a call was added, or close() began
        self._closing = threading.Event()
        self._stop = threading.Event()  # close() gave up waiting: send nothing more
        self._thread = threading.Thread(target=self._drain, name="mlflow-logger", daemon=True)
        self._thread.start()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)  # stamped now, not when MLflow takes it
        points = [[k, float(v), now_ms, step] for k, v in metrics.items()]
        self._add("metrics", f"metrics {', '.join(metrics)} at step {step}", {"points": points})

    def log_artifact(
        self, local_path: str, artifact_path: str | None = None, origin: str | None = None
    ) -> None:
        # The spool keeps a copy: the caller may delete its file as soon as we return.
        name = "/".join(p for p in (artifact_path, os.path.basename(local_path)) if p)
        body = {"artifact_path": artifact_path}
        self._add("artifact", f"artifact {name}", body, file=local_path, origin=origin)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        tags = {k: str(v) for k, v in tags.items()}
        what = "tags " + ", ".join(f"{k}={v}" for k, v in tags.items())
        self._add("tags", what, {"tags": tags})

    def close(self, heartbeat: Callable[[], None] | None = None) -> list[Unsent]:
        """Wait (bounded) until MLflow took everything; what it still lacks then.

        `heartbeat` is called every few seconds while waiting (the launcher's watchdog must
        not take a long wait for a hung rank). After the wait nothing more is sent; the calls
        left stay on disk in the spool folder, which the returned list names.
        """
        self._closing.set()
        self._wake.set()
        deadline = time.monotonic() + self._close_timeout_s
        while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            self._thread.join(min(left, 5.0))
            if heartbeat is not None:
                heartbeat()
        self._stop.set()
        unsent = self.spool.unsent()
        if unsent:
            log.error(
                "MLflow run %s is missing %d logging calls after waiting %.0fs (%s); they "
                "stay in %s: %s",
                self._logger.run.run_id, len(unsent), self._close_timeout_s,
                FLUSH_TIMEOUT_ENV, self.spool.folder, "; ".join(u.line() for u in unsent),
            )  # fmt: skip
        else:
            self.spool.remove_folder_if_empty()
        return unsent

    def _add(self, kind: str, what: str, body: dict, **file: str | None) -> None:
        if self.spool.add(kind, what, body, **file):  # False: listed as missing, logged
            self._wake.set()

    def _drain(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._wake.clear()
            entry = self.spool.oldest()
            if entry is None:
                if self._closing.is_set():
                    return
                self._wake.wait()
                continue
            try:
                self._send(entry)
            except Exception as error:  # noqa: BLE001 - logging must never stop training
                failures += 1
                if failures == 1:
                    log.warning(
                        "MLflow did not take %s (%s); it and every later logging call wait "
                        "on disk in %s and are sent when MLflow answers again",
                        entry.what, redact_text(str(error)), self.spool.folder,
                    )  # fmt: skip
                # A call that failed may still have reached MLflow: read its steps again.
                self._logged_before.clear()
                self._stop.wait(min(2.0 ** min(failures, 10), self._retry_max_s))
                continue
            if failures:
                log.warning("MLflow answers again after %d failed tries: sending", failures)
                failures = 0
            self.spool.remove(entry)

    def _send(self, entry: Entry) -> None:
        run_id = self._logger.run.run_id
        if entry.kind == "metrics":
            batch = [Metric(k, v, ts, step) for k, v, ts, step in entry.body["points"]]
            new = [m for m in batch if m.step > self._last_step_logged_before(m.key)]
            if new:
                self._logger.client.log_batch(run_id, metrics=new)
            for m in new:
                self._logged_before[m.key] = max(m.step, self._logged_before.get(m.key, -1))
        elif entry.kind == "artifact":
            assert entry.file is not None
            self._logger.client.log_artifact(run_id, entry.file, entry.body["artifact_path"])
        else:
            self._logger.set_tags(entry.body["tags"])

    def _last_step_logged_before(self, key: str) -> int:
        if key not in self._logged_before:
            history = self._logger.client.get_metric_history(self._logger.run.run_id, key)
            self._logged_before[key] = max((m.step for m in history), default=-1)
        return self._logged_before[key]


def spool_folder(checkpoint_root: str, run_id: str) -> Path:
    """Where rank 0's logging calls wait: beside the run's checkpoints when they are in a
    local folder (artifacts/runs/<run_id>/tracking-spool), else a local temporary folder
    (an outage of MLflow should not depend on S3 being up). One subfolder per attempt: an
    attempt that was restarted never shares its files with the next."""
    attempt = uuid.uuid4().hex[:12]
    if "://" not in checkpoint_root or checkpoint_root.startswith("file://"):
        local = Path(checkpoint_root.removeprefix("file://")).parent
    else:
        local = Path(tempfile.gettempdir()) / "ddpflow-tracking-spool" / run_id
    return local / "tracking-spool" / attempt


def logger_for_rank(
    is_main: bool, run: RunRef, spool_dir: str | Path | None = None
) -> MetricLogger:
    """Rank-0 gating, declared once: rank 0 logs to MLflow, the others log nowhere."""
    return BackgroundMlflowLogger(run, spool_dir) if is_main else NullLogger()


def close_logger(logger: MetricLogger, heartbeat: Callable[[], None] | None = None) -> list[Unsent]:
    """Flush a logger that buffers (bounded); what MLflow still lacks ([] for the others)."""
    close = getattr(logger, "close", None)
    if close is None:
        return []
    return close(heartbeat) if isinstance(logger, BackgroundMlflowLogger) else close() or []


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


def end_run(
    run: RunRef,
    failed: bool = False,
    timeout_s: float = END_RUN_TIMEOUT_S,
    unsent: Sequence[Unsent] = (),
) -> None:
    """Mark the run FINISHED or FAILED, waiting at most `timeout_s` for MLflow.

    With `unsent` (logging calls MLflow never took) the run first gets the tag
    `ddpflow.tracking_incomplete`, so a reader of the run sees that it lacks something.

    A run is marked FAILED on the way out of an error the caller re-raises, so that never
    raises: with MLflow down it logs a warning and the original error comes through. A run
    that finished but cannot be marked so raises (TimeoutError or MLflow's error): it stays
    RUNNING in MLflow.
    """
    status = "FAILED" if failed else "FINISHED"
    client = MlflowClient(run.tracking_uri)
    what = f"marking MLflow run {run.run_id} {status} at {redact_url(run.tracking_uri)}"

    def mark() -> None:
        if unsent:
            client.set_tag(run.run_id, TRACKING_INCOMPLETE_TAG, incomplete_note(unsent))
        client.set_terminated(run.run_id, status)

    try:
        call_bounded(mark, timeout_s, what)
    except Exception as error:
        if not failed:
            raise
        log.warning("%s failed, the run stays RUNNING: %s", what, redact_text(str(error)))


def incomplete_note(unsent: Sequence[Unsent]) -> str:
    """The tag's value: how many calls are missing and where they wait."""
    paths = [u.path for u in unsent if u.path]
    reasons = sorted({u.not_kept_because for u in unsent if not u.path})
    note = f"{len(unsent)} logging calls are not in this run"
    if reasons:
        note += f" ({len(unsent) - len(paths)} not kept: {'; '.join(reasons)})"
    if paths:
        note += f"; the others wait on disk under {os.path.commonpath(paths)}"
    return note[:MAX_PARAM_LEN]


def metric_history(run: RunRef, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, in step order."""
    history = MlflowClient(run.tracking_uri).get_metric_history(run.run_id, key)
    return sorted((m.step, m.value) for m in history)
