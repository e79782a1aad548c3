"""A test's project folder: its isolated environment (artifact folder, MLflow
store, Prefect home, both databases starting migrated), flows and commands run
in it, and its records read back."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from ddpflow.integrations.prefect import db_template as prefect_db_template
from ddpflow.tracking.store import template as mlflow_store_template
from tests.helpers.charlm_runs import SMALL_SOURCE
from tests.helpers.paths import CHECKOUT


@functools.cache
def migrated_prefect_db() -> Path:
    """A Prefect database with every migration applied: the one `make venv` installs
    (ddpflow/integrations/prefect/db_template.py), else one made once per test session.

    A flow run without PREFECT_API_URL starts Prefect's embedded API, which on a fresh
    database first runs every migration: about 15 s of each flow run's start on a loaded
    2-core machine. Each project gets a copy of this one, so its runs skip that and stay
    isolated from every other test's.
    """
    installed = prefect_db_template.template_path()
    if installed is not None and installed.is_file():
        return installed
    folder = Path(tempfile.mkdtemp(prefix="ddpflow-prefect-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return prefect_db_template.build(folder / "prefect.db")


@functools.cache
def migrated_mlflow_db() -> Path:
    """An MLflow SQLite store with its tracking and registry schema: the one `make venv`
    installs (ddpflow/tracking/store/template.py), else one made once per test session.

    A training's first MLflow call on a fresh store runs every migration: about 4 s of each
    training flow on a loaded 2-core machine. Each project gets a copy of this empty store
    (tests/integration/test_sqlite_store.py creates fresh ones on purpose).
    """
    installed = mlflow_store_template.template_path()
    if installed is not None and installed.is_file():
        return installed
    folder = Path(tempfile.mkdtemp(prefix="ddpflow-mlflow-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return mlflow_store_template.build(folder / "mlflow.db")


def project_env(project: Path, first_project: bool = False) -> dict[str, str]:
    """An isolated project: its own artifact folder, MLflow SQLite file and Prefect home,
    both databases starting migrated and empty (a file already there is kept). With
    `first_project` neither database is there, as in a user's first project: the flow's own
    start makes them (from the installed templates, where `make venv` built them)."""
    templates = [
        (project / "mlflow.db", migrated_mlflow_db),
        (project / ".prefect" / "prefect.db", migrated_prefect_db),
    ]
    for database, template in templates:
        if not first_project and not database.exists():
            database.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(template(), database)
    # DASK_* too: a nanny in this test process (a LocalCluster fixture) copies its
    # pre-spawn variables into this process's environment, e.g. quiet worker logging.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DASK_"))
    }
    env.update(
        {
            "DDPFLOW_ARTIFACT_ROOT": str(project / "artifacts"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
            "PREFECT_HOME": str(project / ".prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # The first start on a fresh database (migrations) can take longer than the
            # ephemeral API's default 20 s limit on a loaded machine.
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
            "PYTHONPATH": str(CHECKOUT),
        }
    )
    env.pop("DDPFLOW_DASK_ADDRESS", None)
    return env


def tiny_charlm_params(
    epochs: int, source: str | None = SMALL_SOURCE, **overrides: object
) -> dict[str, object]:
    """A pet-name training small enough for a test, as the flow's parameter model takes it:
    one LSTM layer of 16, batches of 4096, on the first sixth of the shipped names
    (source=None: no source, the flow's default, all of them); `overrides` (e.g.
    keep_last=2) add or replace fields."""
    sizes = {"epochs": epochs, "hidden_size": 16, "num_layers": 1, "batch_size": 4096}
    return {**({"source": source} if source else {}), **sizes, **overrides}


def tiny_charlm(epochs: int, **overrides: object) -> list[str]:
    """tiny_charlm_params as command-line options."""
    options = tiny_charlm_params(epochs, **overrides)
    return [item for k, v in options.items() for item in (f"--{k.replace('_', '-')}", str(v))]


def project_tracking(project: Path) -> MlflowClient:
    """An MLflow client on the project's own SQLite store (project_env's)."""
    return MlflowClient(f"sqlite:///{project / 'mlflow.db'}")


def prefect_cli(
    project: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    """`prefect ARGS...` on the project's Prefect database, e.g. ("flow-run", "inspect", id)."""
    return run_in_project([sys.executable, "-m", "prefect", *args], project, env, timeout_s)


def run_in_project(
    argv: list[str],
    project: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    first_project: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`argv` in the project folder with its isolated environment (project_env) plus `env`;
    output captured, the exit code left to the caller."""
    return subprocess.run(
        argv,
        cwd=project,
        env={**project_env(project, first_project), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def prefect_records(project: Path) -> dict[str, list[dict[str, Any]]]:
    """Every flow run, task run and artifact in the project's Prefect database, oldest
    first, with the names Prefect's API gives their fields (an artifact's `data` decoded).

    Read from the file: the flow's embedded API stopped with it, and a client would start
    another on the database (6.6 CPU-seconds for one read, 2026-12-07); the file answers in
    a millisecond, and a schema Prefect changes fails here loudly (no such table or column)."""
    with contextlib.closing(sqlite3.connect(project / ".prefect" / "prefect.db")) as db:
        db.row_factory = sqlite3.Row
        flow_runs = [dict(row) for row in db.execute("SELECT * FROM flow_run ORDER BY created")]
        task_runs = [dict(row) for row in db.execute("SELECT * FROM task_run ORDER BY created")]
        artifacts = [dict(row) for row in db.execute("SELECT * FROM artifact ORDER BY created")]
    for artifact in artifacts:
        # A JSON column: SQLite hands numbers back as numbers, anything else as JSON text.
        if isinstance(artifact["data"], str):
            artifact["data"] = json.loads(artifact["data"])
    return {"flow_runs": flow_runs, "task_runs": task_runs, "artifacts": artifacts}


def run_flow(
    module: str,
    args: list[str],
    project: Path,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
    first_project: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m flows.<module> ...` the way a user does, in the project folder
    (`first_project`: see project_env)."""
    project.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", f"flows.{module}", *args]
    return run_in_project(argv, project, env, timeout_s, first_project)
