"""System metrics (CPU, memory, disk, network, GPU when there is one) from every rank.

MLflow's own SystemMetricsMonitor does the sampling on a thread of the rank's process: a
sample every `sampling_interval` seconds (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides
it), logged as `system/rank<N>/<metric>` so each rank is its own series in the run's System
metrics tab. The step loop never waits for it. Starting and stopping are bounded: a slow or
dead tracking server costs a rank at most a few seconds, never the minutes MLflow's client
retries, and a monitor that cannot start only means no system metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from ddpflow.storage.bounded import call_bounded
from ddpflow.storage.redact import redact_text
from ddpflow.tracking.loggers import RunRef

log = logging.getLogger(__name__)
DEFAULT_SAMPLING_INTERVAL_S = 10.0
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 15.0
SYSTEM_PREFIX = "system/"


def node_id(rank: int) -> str:
    """The series name of one rank: its metrics are `system/<node_id>/<metric>`."""
    return f"rank{rank}"


@contextmanager
def rank_system_metrics(
    run: RunRef, rank: int, sampling_interval_s: float = DEFAULT_SAMPLING_INTERVAL_S
) -> Iterator[None]:
    """Sample this rank's system metrics into `run` while the block runs."""
    monitor = _start(run, rank, sampling_interval_s)
    try:
        yield
    finally:
        if monitor is not None:
            _stop(monitor, run)


def _quiet_mlflow_monitor() -> None:
    """MLflow's monitor says "Started monitoring system metrics.", "Skip logging GPU
    metrics..." and two lines at its stop, at INFO, per rank and attempt, in MLflow's own
    log format: noise in a flow's output. Shown at WARNING and above unless the user set
    the `mlflow.system_metrics` logger's level (DEBUG shows them again)."""
    monitor_log = logging.getLogger("mlflow.system_metrics")
    if monitor_log.level == logging.NOTSET:
        monitor_log.setLevel(logging.WARNING)


def _start(run: RunRef, rank: int, sampling_interval_s: float) -> SystemMetricsMonitor | None:
    _quiet_mlflow_monitor()

    def start() -> SystemMetricsMonitor:
        # resume_logging: a restarted attempt continues the step count of the one before.
        monitor = SystemMetricsMonitor(
            run.run_id,
            sampling_interval=sampling_interval_s,
            resume_logging=True,
            node_id=node_id(rank),
            tracking_uri=run.tracking_uri,
        )
        monitor.start()
        return monitor

    try:
        return call_bounded(start, START_TIMEOUT_S, "starting the system metrics monitor")
    except Exception as error:  # noqa: BLE001 - no system metrics is no reason to stop training
        log.warning("rank %d logs no system metrics: %s", rank, redact_text(str(error)))
        return None


def _stop(monitor: SystemMetricsMonitor, run: RunRef) -> None:
    def stop() -> None:
        monitor.finish()
        # MLflow's loop drops the sample it took before the shutdown; log it, so a training
        # shorter than the sampling interval still has one point per rank.
        pending = monitor.aggregate_metrics()
        if pending:
            monitor.publish_metrics(pending)
            monitor.mlflow_logger.flush()

    try:
        call_bounded(stop, STOP_TIMEOUT_S, f"stopping the system metrics of run {run.run_id}")
    except Exception as error:  # noqa: BLE001 - the training itself is done
        log.warning("system metrics were not all logged: %s", redact_text(str(error)))
