"""Rank 0's MLflow logger never makes training wait, even for a dead server."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from ddpflow.tracking.loggers import BackgroundMlflowLogger, RunRef, close_logger
from ddpflow.tracking.run import default_artifact_location, start_run


def sqlite_run(folder: Path) -> RunRef:
    """A run in a SQLite store in `folder`, its artifacts there too (MLflow's default is
    ./mlruns in the working directory, the checkout), as the flows keep them."""
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    return start_run(uri, "bg", "bg", {}, {}, default_artifact_location(uri, folder))


def test_everything_logged_is_in_mlflow_after_close(tmp_path):
    run = sqlite_run(tmp_path)
    logger = BackgroundMlflowLogger(run)
    artifact = tmp_path / "epoch-0001.pt"
    artifact.write_bytes(b"checkpoint bytes")
    for step in range(1, 6):
        logger.log_metrics({"train_loss": 1.0 / step}, step=step)
    logger.log_artifact(str(artifact), "checkpoints")
    artifact.unlink()  # the caller may delete its file at once
    logger.set_tags({"ddpflow.latest_checkpoint": "somewhere"})
    close_logger(logger)
    client = MlflowClient(run.tracking_uri)
    assert [m.step for m in client.get_metric_history(run.run_id, "train_loss")] == [1, 2, 3, 4, 5]
    assert [a.path for a in client.list_artifacts(run.run_id, "checkpoints")] == [
        "checkpoints/epoch-0001.pt"
    ]
    assert client.get_run(run.run_id).data.tags["ddpflow.latest_checkpoint"] == "somewhere"


def test_a_dead_server_never_blocks_the_caller():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logger = BackgroundMlflowLogger(
        RunRef(f"http://127.0.0.1:{port}", "0" * 32), close_timeout_s=2.0
    )
    started = time.monotonic()
    for step in range(100):
        logger.log_metrics({"train_loss": 1.0}, step=step)
    # A blocking call would wait out a retry per call (seconds each, 100 calls); enqueuing
    # takes milliseconds, with room for a loaded machine.
    assert time.monotonic() - started < 2.0, "logging only enqueues"
    logger.close()
    assert time.monotonic() - started < 10, "close waits a bounded time"


def test_a_restarted_attempt_does_not_log_a_step_twice(tmp_path):
    """Attempt 1 logs steps 1-7 and dies; attempt 2 resumes from the checkpoint at step 4
    and logs 5-10 again: each step is in MLflow once, with attempt 1's value up to 7."""
    run = sqlite_run(tmp_path)
    first = BackgroundMlflowLogger(run)
    for step in range(1, 8):
        first.log_metrics({"train_loss": float(step)}, step=step)
    close_logger(first)
    second = BackgroundMlflowLogger(run)
    for step in range(5, 11):
        second.log_metrics({"train_loss": float(step) + 0.5, "lr": 0.1}, step=step)
    close_logger(second)
    client = MlflowClient(run.tracking_uri)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.run_id, "train_loss"))
    assert history == [(s, float(s)) for s in range(1, 8)] + [(s, s + 0.5) for s in (8, 9, 10)]
    assert [m.step for m in client.get_metric_history(run.run_id, "lr")] == list(range(5, 11))


def _slow_sends(logger: BackgroundMlflowLogger, seconds: float) -> None:
    """Each metric batch takes `seconds` to reach MLflow (a slow server)."""
    send = logger._calls.log_batch

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return send(*args, **kwargs)

    logger._calls.log_batch = slow  # type: ignore[method-assign]


# docs/fault-tolerance.md: a checkpoint is written only after rank 0's queued metrics are in
# MLflow (bounded), because a resume never logs the epochs before its checkpoint again.
def test_flush_returns_once_the_queued_metrics_are_in_mlflow(tmp_path):
    run = sqlite_run(tmp_path)
    logger = BackgroundMlflowLogger(run)
    _slow_sends(logger, 1.0)
    logger.log_metrics({"val_loss": 0.5}, step=1)
    assert logger.flush(30)
    history = MlflowClient(run.tracking_uri).get_metric_history(run.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5)]
    close_logger(logger)


def test_flush_is_bounded_when_mlflow_is_slow(tmp_path):
    run = sqlite_run(tmp_path)
    logger = BackgroundMlflowLogger(run)
    _slow_sends(logger, 3.0)
    logger.log_metrics({"val_loss": 0.5}, step=1)
    started = time.monotonic()
    assert not logger.flush(0.5)
    assert time.monotonic() - started < 2.5, "the flush waited for the slow call"
    close_logger(logger)  # the call is still sent
    history = MlflowClient(run.tracking_uri).get_metric_history(run.run_id, "val_loss")
    assert [m.step for m in history] == [1]
