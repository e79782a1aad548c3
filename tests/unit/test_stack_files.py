"""The local stack's state.json and env.sh hold its credentials: owner-only from creation."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.state import StackState, client_env

PORTS = {"prefect": 4200, "mlflow": 5000, "s3": 9000, "dask": 8786}


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 0: a file not created 0600 on purpose would be world-readable (and writable)."""
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_and_env_files_are_owner_only(tmp_path: Path, open_umask: None) -> None:
    # The S3 user's key, as `up` adds it (infra.auth).
    env = {**client_env(PORTS), "AWS_ACCESS_KEY_ID": "LKIA1", "AWS_SECRET_ACCESS_KEY": "s3cret"}
    state = StackState(dir=tmp_path, ports=PORTS, env=env)
    for old in (state.state_path, state.env_path):  # a looser file from an older version
        old.write_text("old")
        old.chmod(0o644)
    state.save()
    state.write_env_file()
    assert mode(state.state_path) == 0o600
    assert mode(state.env_path) == 0o600
    assert json.loads(state.state_path.read_text())["env"] == env
    assert "export AWS_SECRET_ACCESS_KEY=s3cret" in state.env_path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.sh", "state.json"], "no temp left"


def test_saving_again_keeps_the_mode_and_loads_back(tmp_path: Path, open_umask: None) -> None:
    state = StackState(dir=tmp_path, ports=PORTS, env=client_env(PORTS))
    state.save()
    state.total_startup_s = 12.5
    state.save()
    assert mode(state.state_path) == 0o600
    loaded = StackState.load(tmp_path)
    assert loaded is not None and loaded.total_startup_s == 12.5
