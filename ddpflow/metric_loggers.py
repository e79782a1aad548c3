"""Rank 0's metric loggers: where a rank logs (RunRef), and how (in MLflow, on a background
thread that never blocks training, or nowhere on the other ranks)."""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)


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
