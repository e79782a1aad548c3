"""A project's first MLflow store copied from the installed template
(ddpflow/tracking/store/template.py, ddpflow/tracking/store/sqlite.py). A flow's first run on it:
`integration/test_train_charlm_flow.py`."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.sqlite_template import copy_into_place
from ddpflow.tracking.store import template
from ddpflow.tracking.store.sqlite import prepare_sqlite_store


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return template.build(tmp_path_factory.mktemp("template") / "mlflow.db")


@pytest.fixture
def installed(built: Path, monkeypatch) -> Path:
    monkeypatch.setenv(template.TEMPLATE_VARIABLE, str(built))
    return built


def rows(database: Path, query: str) -> list[tuple]:
    with closing(sqlite3.connect(database)) as db:
        return db.execute(query).fetchall()


def test_the_template_is_named_by_mlflows_version_under_the_environment():
    expected = f"mlflow-{importlib.metadata.version('mlflow')}.db"
    assert template.template_path({}) == Path(sys.prefix) / "share" / "ddpflow" / expected


def test_the_template_has_the_schema_and_no_experiment(built):
    assert rows(built, "SELECT count(*) FROM alembic_version") == [(1,)]
    assert rows(built, "SELECT count(*) FROM experiments") == [(0,)]


def test_a_new_store_is_seeded_and_mlflow_adds_its_default_experiment_here(
    tmp_path, installed, monkeypatch, caplog
):
    monkeypatch.chdir(tmp_path)  # MLflow puts the Default experiment's artifacts in ./mlruns
    database = tmp_path / "project" / "mlflow.db"
    database.parent.mkdir()
    uri = f"sqlite:///{database}"
    with caplog.at_level(logging.INFO, logger="ddpflow.tracking.store.sqlite"):
        prepare_sqlite_store(uri)
    assert f"{template.SEEDED_FROM} to {database}" in caplog.text
    assert "Creating initial MLflow database tables" not in caplog.text
    client = MlflowClient(uri, registry_uri=uri)
    default = client.get_experiment("0")
    assert (default.name, default.artifact_location) == ("Default", str(tmp_path / "mlruns/0"))
    run = client.create_run(client.create_experiment("e"))
    client.log_metric(run.info.run_id, "loss", 1.0)
    client.create_registered_model("m")  # the registry schema came with it
    assert [m.name for m in client.search_registered_models()] == ["m"]
    assert database.stat().st_mode & 0o777 == 0o666 & ~_umask(), "as SQLite creates a file"
    assert sorted(p.name for p in database.parent.iterdir()) == ["mlflow.db", "mlflow.db.lock"]


def test_an_existing_store_is_never_replaced(tmp_path, installed):
    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("the user's")
    assert template.seed(database) is False
    assert [e.experiment_id for e in client.search_experiments()] == [experiment, "0"]


def test_a_template_that_is_not_a_database_is_not_copied(tmp_path):
    broken = tmp_path / "template.db"
    broken.write_bytes(b"<html>a failed download</html>")
    assert copy_into_place(broken, tmp_path / "store" / "mlflow.db") is False
    assert not (tmp_path / "store" / "mlflow.db").exists()


def test_without_a_template_mlflow_makes_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv(template.TEMPLATE_VARIABLE, str(tmp_path / "missing.db"))
    database = tmp_path / "mlflow.db"
    assert template.seed(database) is False
    prepare_sqlite_store(f"sqlite:///{database}")
    assert rows(database, "SELECT name FROM experiments") == [("Default",)]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
