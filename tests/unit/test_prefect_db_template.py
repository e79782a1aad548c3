"""Copying the installed Prefect database template into a new PREFECT_HOME
(ddpflow/integrations/prefect/db_template.py). Files only: the flow that starts its embedded API on
the copy runs in `integration/test_train_charlm_flow.py`."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from ddpflow.integrations.prefect import db_template as template

SCHEMA = b"SQLite format 3\x00 the migrated schema"


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    path = tmp_path / "share" / "prefect-template.db"
    path.parent.mkdir()
    path.write_bytes(SCHEMA)
    return path


def env(home: Path, installed: Path, **more: str) -> dict[str, str]:
    return {"PREFECT_HOME": str(home), template.TEMPLATE_VARIABLE: str(installed), **more}


def test_the_template_is_named_by_prefects_version_under_the_environment():
    expected = f"prefect-{importlib.metadata.version('prefect')}.db"
    assert template.template_path({}) == Path(sys.prefix) / "share" / "ddpflow" / expected


def test_a_new_home_gets_a_copy_of_the_template(tmp_path, installed):
    home = tmp_path / "new-home"
    assert template.seed(env(home, installed)) == home / "prefect.db"
    assert (home / "prefect.db").read_bytes() == SCHEMA
    assert [p.name for p in home.iterdir()] == ["prefect.db"], "no partial copy left"
    assert home.stat().st_mode & 0o777 == 0o700


def test_an_existing_database_is_never_replaced(tmp_path, installed):
    home = tmp_path / "home"
    home.mkdir()
    (home / "prefect.db").write_bytes(b"the user's runs")
    assert template.seed(env(home, installed)) is None
    assert (home / "prefect.db").read_bytes() == b"the user's runs"


@pytest.mark.parametrize("variable", template.DATABASE_URL_VARIABLES)
def test_a_configured_database_elsewhere_gets_nothing(tmp_path, installed, variable):
    home = tmp_path / "home"
    settings = {variable: "postgresql+asyncpg://db/prefect"}
    assert template.seed(env(home, installed, **settings)) is None
    assert not home.exists()


def test_without_a_template_prefect_makes_its_own(tmp_path):
    home = tmp_path / "home"
    assert template.seed(env(home, tmp_path / "missing.db")) is None
    assert not (home / "prefect.db").exists()


def test_a_template_that_is_not_a_database_is_not_copied(tmp_path, installed):
    installed.write_bytes(b"<html>a failed download</html>")
    home = tmp_path / "home"
    assert template.seed(env(home, installed)) is None
    assert not (home / "prefect.db").exists()
