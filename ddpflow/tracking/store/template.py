"""A migrated MLflow SQLite store, built once per install, for a project's first run.

MLflow creates a new `sqlite:///` store's tracking and registry schema on first use by
running every migration: about 1 s on a quiet 2-core machine, 2-3 s while a flow's workers
start beside it, and on a flow's critical path (its run is created before any rank starts).
What the migrations leave names nothing of the project but one row, MLflow's "Default"
experiment, whose artifact location is the creating process's `./mlruns`. The template is
that store without the row:

- `python -m ddpflow.tracking.store.template` (run by `make venv`) creates a store in a
  throw-away folder, deletes the Default experiment and keeps the file, named by MLflow's
  version, under the environment's prefix (`<venv>/share/ddpflow/`);
- `ddpflow.tracking.store.sqlite.prepare_sqlite_store` copies it where a store is about to be
  created (`seed`); MLflow then finds its schema and, as on any store without one, creates the
  Default experiment itself, with the path it would have given it. Where there is a store
  already, or no template of this MLflow version, nothing is copied and MLflow migrates.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path

from ddpflow.sqlite_template import copy_into_place, installed_path, vacuum_into

TEMPLATE_VARIABLE = "DDPFLOW_MLFLOW_DB_TEMPLATE"  # another template file, for tests and images
SEEDED_FROM = "schema copied from the installed template"
DEFAULT_EXPERIMENT_ID = 0  # MLflow's, created by the store that opens a database without it


def template_path(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The template for the installed MLflow, whether or not it exists; None without MLflow."""
    return installed_path("mlflow", TEMPLATE_VARIABLE, environ)


def seed(database: Path, environ: Mapping[str, str] = os.environ) -> bool:
    """Copy the template to `database` if there is none yet; whether it was copied. Never
    replaces a database (ddpflow.sqlite_template.copy_into_place)."""
    template = template_path(environ)
    return template is not None and copy_into_place(template, database)


def build(target: Path | None = None) -> Path:
    """Create a store's schema in a throw-away folder, keep it at `target` without the
    Default experiment (by default where `seed` looks)."""
    target = target or template_path()
    if target is None:
        raise RuntimeError("MLflow is not installed: there is no store to make")
    with tempfile.TemporaryDirectory(prefix="ddpflow-mlflow-store-") as folder:
        database = Path(folder) / "mlflow.db"
        create_schema(f"sqlite:///{database}")
        with closing(sqlite3.connect(database)) as db, db:
            db.execute("DELETE FROM experiments WHERE experiment_id = ?", (DEFAULT_EXPERIMENT_ID,))
        vacuum_into(database, target)
    return target


def create_schema(tracking_uri: str) -> None:
    """Open the store as MLflow does on first use, which creates what is missing of its
    tracking and registry schema (and the Default experiment)."""
    # Imported here: `seed` is all a server's start needs (infra.services), without MLflow's
    # second of imports.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    client.search_experiments(max_results=1)  # the tracking schema
    client.search_registered_models(max_results=1)  # the registry schema


if __name__ == "__main__":
    print(f"MLflow store template: {build()}")
