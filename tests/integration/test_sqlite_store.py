"""Two trainings that start together on a fresh embedded MLflow store (a SQLite file)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.integration


def _start_run(uri: str, name: str, barrier: Any) -> str:
    from ddpflow.tracking.run import (
        start_run,  # imported before the barrier: the race is the store's
    )

    barrier.wait(timeout=300)
    return start_run(uri, "ddpflow-charlm", name, {"lr": 0.01}, {}).run_id


def test_two_runs_started_together_on_a_fresh_store_both_start(tmp_path: Path):
    # docs/configuration.md: the default SQLite store can be used by several runs at once
    # from its first use. Without the lock one of the two fails creating the schema
    # ("duplicate column name" / "Online migration expected to match one row").
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(2) as pool:
        barrier = manager.Barrier(2)  # a Pool's tasks take a barrier only through a manager
        pending = [pool.apply_async(_start_run, (uri, f"run-{i}", barrier)) for i in range(2)]
        run_ids = [p.get(timeout=600) for p in pending]
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "ddpflow-charlm"]
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(run_ids)
    assert {r.data.params["lr"] for r in runs} == {"0.01"}
