"""Rank 0's metric loggers: where a rank logs (RunRef), and how (in MLflow, through an
on-disk spool and a background thread that never block training, or nowhere on the other
ranks)."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ddpflow.storage.redact import error_text, redact_text
from ddpflow.tracking.one_try import OneTryCalls
from ddpflow.tracking.spool import (
    FLUSH_TIMEOUT_ENV,
    Entry,
    Spool,
    Unsent,
    flush_timeout_s,
    spool_max_bytes,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRef:
    """Where to log: small and picklable, handed to every rank."""

    tracking_uri: str
    run_id: str
    # The run's experiment, where the run was started here: the UI's link to the run names
    # it (MLflow drops the link's query when it resolves a bare run id).
    experiment_id: str | None = None


# The longest rank 0 waits at a checkpoint for MLflow to take the epoch's metrics.
CHECKPOINT_FLUSH_TIMEOUT_S = 10.0


class MetricLogger(Protocol):
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(
        self, local_path: str, artifact_path: str | None = None, origin: str | None = None
    ) -> None: ...

    def keep_artifacts(self, artifact_path: str, names: Sequence[str]) -> None: ...

    def set_tags(self, tags: Mapping[str, str]) -> None: ...


class NullLogger:
    """What every rank but 0 gets: the training loop never branches on rank to log."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(
        self, local_path: str, artifact_path: str | None = None, origin: str | None = None
    ) -> None:
        pass

    def keep_artifacts(self, artifact_path: str, names: Sequence[str]) -> None:
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

    def keep_artifacts(self, artifact_path: str, names: Sequence[str]) -> None:
        OneTryCalls(self.run.tracking_uri, self.run.run_id).keep_artifacts(artifact_path, names)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.client.log_batch(self.run.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


class BackgroundMlflowLogger:
    """An MlflowLogger whose calls wait on disk and are sent by a background thread, in order.

    Rank 0 never waits for MLflow: a slow or dead server would otherwise stall rank 0, and
    with it every other rank at the next collective (MLflow's client retries a failing server
    for minutes). Each call is first written to a bounded folder (ddpflow.tracking.spool), so
    an outage only delays it: a call that fails is retried, the oldest first, until MLflow
    takes it. Each try is one request (ddpflow.tracking.one_try): a server gone mid-call fails
    it at once instead of holding it in MLflow's client retries for minutes. `close()` waits
    a bounded time for what waits and returns what MLflow still lacks then.

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
        self._run = run
        self._calls = OneTryCalls(run.tracking_uri, run.run_id)
        self._close_timeout_s = flush_timeout_s() if close_timeout_s is None else close_timeout_s
        self.spool = _open_spool(spool_dir, max_spool_bytes or spool_max_bytes())
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

    def keep_artifacts(self, artifact_path: str, names: Sequence[str]) -> None:
        """Delete the run's files in `artifact_path` but `names`, after every call before."""
        body = {"artifact_path": artifact_path, "names": list(names)}
        self._add("keep", f"pruning {artifact_path}/ to {', '.join(names)}", body)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        tags = {k: str(v) for k, v in tags.items()}
        what = "tags " + ", ".join(f"{k}={v}" for k, v in tags.items())
        self._add("tags", what, {"tags": tags})

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until MLflow took every call added so far; True if it did.

        Called before each checkpoint: a resume starts after the checkpoint and never logs
        its epochs again, and a restarted attempt spools into a folder of its own, so the
        epoch's calls should be in MLflow before the checkpoint exists. With MLflow down
        this gives up after `timeout_s`; the calls stay on disk and are still sent.
        """
        last = self.spool.last_seq()
        deadline = time.monotonic() + timeout_s
        while (oldest := self.spool.oldest()) is not None and oldest.seq <= last:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.02)
        return True

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
                self._run.run_id, len(unsent), self._close_timeout_s,
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
        if entry.kind == "metrics":
            batch = [Metric(k, v, ts, step) for k, v, ts, step in entry.body["points"]]
            new = [m for m in batch if m.step > self._last_step_logged_before(m.key)]
            if new:
                self._calls.log_batch(metrics=new)
            for m in new:
                self._logged_before[m.key] = max(m.step, self._logged_before.get(m.key, -1))
        elif entry.kind == "artifact":
            assert entry.file is not None
            self._calls.log_artifact(entry.file, entry.body["artifact_path"])
        elif entry.kind == "keep":
            self._prune(entry)
        else:
            self._calls.log_batch(tags=[RunTag(k, v) for k, v in entry.body["tags"].items()])

    def _prune(self, entry: Entry) -> None:
        """Best effort: a store that refuses deletes (a read-only or append-only artifact
        store, a user without the permission) keeps older copies, and the calls after this
        one must not wait on it as they would on an outage."""
        try:
            self._calls.keep_artifacts(entry.body["artifact_path"], entry.body["names"])
        except Exception as error:  # noqa: BLE001 - see above
            if not _outage_like(error):
                log.warning("MLflow kept older copies (%s): %s", entry.what, error_text(error))
                return
            raise

    def _last_step_logged_before(self, key: str) -> int:
        if key not in self._logged_before:
            self._logged_before[key] = max(self._calls.logged_steps(key), default=-1)
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


def _open_spool(spool_dir: str | Path | None, max_bytes: int) -> Spool:
    """The spool in `spool_dir`, or in a temporary folder when there is none or it cannot
    be created there (e.g. a run folder the store refuses): where the calls wait must
    never be what stops a training, and the checkpoint write reports that store itself."""
    if spool_dir is not None:
        try:
            return Spool(Path(spool_dir), max_bytes)
        except OSError as error:
            log.warning(
                "cannot keep logging calls in %s (%s): using a temporary folder", spool_dir, error
            )
    return Spool(Path(tempfile.mkdtemp(prefix="ddpflow-spool-")), max_bytes)


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


def flush_logger(logger: MetricLogger, timeout_s: float = CHECKPOINT_FLUSH_TIMEOUT_S) -> None:
    """Wait (bounded) until a buffering logger has sent what it holds; a no-op for the
    others. A slow or dead server costs at most `timeout_s`, with a warning."""
    flush = getattr(logger, "flush", None)
    if flush is not None and not flush(timeout_s):
        log.warning(
            "MLflow did not take this epoch's logging calls within %.0fs; the checkpoint is "
            "written anyway, and the calls are still sent while training goes on",
            timeout_s,
        )


def _outage_like(error: Exception) -> bool:
    """Whether a failed call may succeed later (a server down or overloaded), as opposed to
    one the store refuses for good (a 4xx answer, or no delete in that kind of store)."""
    if isinstance(error, NotImplementedError):
        return False
    response = getattr(error, "response", None)  # requests' HTTPError
    status = getattr(response, "status_code", None)
    if status is None and isinstance(error, MlflowException):
        status = error.get_http_status_code()
    return not (isinstance(status, int) and 400 <= status < 500 and status not in (408, 429))
