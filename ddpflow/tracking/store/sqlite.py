"""The embedded MLflow store (a SQLite file), created by one process at a time.

MLflow creates a SQLite store's schema on first use, by running its migrations. Two
processes doing that at once on a fresh file (two `make demo`s, two deployment runs on a
new machine) collide: one fails with "duplicate column name" or "Online migration expected
to match one row". A file lock next to the database serialises that first use; afterwards
every process opens the store as usual, concurrently.

A store about to be created starts as a copy of the migrated schema `make venv` installs
(ddpflow/tracking/store/template.py), which spares its first user the migrations.
"""

from __future__ import annotations

import fcntl
import logging
import time
from pathlib import Path

from ddpflow.tracking.store import template as mlflow_store_template

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 300.0  # creating the schema takes seconds; another process may hold it that long
_POLL_S = 0.2
_prepared: set[str] = set()  # per process: each URI is prepared once


def prepare_sqlite_store(tracking_uri: str, timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Create the tracking and registry schema of a `sqlite:///` store under a file lock.

    Any other URI is left alone (a server serialises its own store).
    """
    if not tracking_uri.startswith("sqlite:///") or tracking_uri in _prepared:
        return
    database = Path(tracking_uri.removeprefix("sqlite:///"))
    lock_path = database.with_name(database.name + ".lock")
    with open(lock_path, "a") as lock:
        _acquire(lock.fileno(), lock_path, timeout_s)
        try:
            if mlflow_store_template.seed(database):
                log.info("MLflow store: %s to %s", mlflow_store_template.SEEDED_FROM, database)
            mlflow_store_template.create_schema(tracking_uri)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    _prepared.add(tracking_uri)


def _acquire(fd: int, lock_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"another process has held the lock {lock_path} for more than "
                    f"{timeout_s:g}s while creating the MLflow store (it is stuck: end it)"
                ) from None
            time.sleep(_POLL_S)
