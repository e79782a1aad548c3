"""A scaling run's sizes in turn, against a real (SQLite) MLflow store: a crash stays local."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import start_run
from ddpflow.training.result import EpochStats
from ddpflow.workloads.scaling import SizeResult, Target, table_rows
from ddpflow.workloads.scaling.report import markdown_table
from flows.scaling import ScalingSummary, finish, run_sizes

EXPERIMENT = "scaling-unit"
NO_TARGET = Target("val_loss", None)


@pytest.fixture
def tracking(tmp_path: Path) -> tuple[str, str]:
    """(tracking URI, artifact location), both in the test's own folder."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "artifacts").as_uri()


def _run(tracking: tuple[str, str], name: str) -> RunRef:
    uri, artifacts = tracking
    return start_run(uri, EXPERIMENT, name, {}, {}, artifact_location=artifacts)


def _history(_: int, __: RunRef) -> list[EpochStats]:
    return [EpochStats(1, 2.0, 1.9, 100.0, 1.0)]


def test_a_size_that_crashes_is_failed_and_the_next_size_still_runs(tracking) -> None:
    trained = []

    def train(size: int, run: RunRef) -> list[EpochStats]:
        trained.append(size)
        if size == 1:
            raise RuntimeError("rank 0 lost")
        return _history(size, run)

    results = run_sizes([1, 2], lambda size: _run(tracking, f"size {size}"), train)
    assert trained == [1, 2]
    assert [(r.world_size, r.completed) for r in results] == [(1, False), (2, True)]
    assert results[0].error == "RuntimeError: rank 0 lost" and results[0].wall_s >= 0
    client = MlflowClient(tracking[0])
    failed = client.get_run(results[0].run_id)
    assert failed.info.status == "FAILED"
    assert failed.data.tags["ddpflow.error"] == "RuntimeError: rank 0 lost"
    assert client.get_run(results[1].run_id).info.status == "FINISHED"


def test_an_interrupt_fails_the_size_and_stops_the_run(tracking) -> None:
    started: list[RunRef] = []

    def start_child(size: int) -> RunRef:
        started.append(_run(tracking, f"size {size}"))
        return started[-1]

    def interrupted(size: int, run: RunRef) -> list[EpochStats]:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sizes([1, 2], start_child, interrupted)
    assert len(started) == 1, "no size starts after an interrupt"
    assert MlflowClient(tracking[0]).get_run(started[0].run_id).info.status == "FAILED"


def _summary(parent: RunRef, results: list[SizeResult]) -> ScalingSummary:
    rows = table_rows(results, NO_TARGET)
    return ScalingSummary("charlm", parent.run_id, rows, markdown_table(rows, NO_TARGET), "k")


def test_the_flow_fails_only_when_no_size_completed(tracking) -> None:
    client = MlflowClient(tracking[0])
    parent = _run(tracking, "none completed")
    summary = _summary(parent, [SizeResult(1, "r1", False, error="boom")])
    with pytest.raises(RuntimeError, match="no world size completed"):
        finish(parent, summary, "hint")
    assert client.get_run(parent.run_id).info.status == "FAILED"

    parent = _run(tracking, "one completed")
    results = [
        SizeResult(1, "r1", False, error="boom"),
        SizeResult(2, "r2", True, _history(2, parent)),
    ]
    assert finish(parent, _summary(parent, results), "hint").num_completed == 1
    assert client.get_run(parent.run_id).info.status == "FINISHED"
