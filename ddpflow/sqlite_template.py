"""SQLite databases made once per install and copied where a new one would be created.

Prefect's server and MLflow's SQLite store both create their database on first use by
running every schema migration: seconds of a new project's first run, spent again in every
new project. What the migrations leave (the schema, and rows that name nothing of the
project) is the same each time, so `make venv` keeps one migrated copy of each under the
environment's prefix and a first use copies it instead (ddpflow/integrations/prefect/db_template.py,
ddpflow/tracking/store/template.py).

Stdlib only: Prefect's copy is made before the flow's own imports.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import sqlite3
import sys
from collections.abc import Mapping
from pathlib import Path

SQLITE_HEADER = b"SQLite format 3\x00"


def installed_path(
    product: str, variable: str, environ: Mapping[str, str] = os.environ
) -> Path | None:
    """`<prefix>/share/ddpflow/<product>-<version>.db` for the installed `product`, whether or
    not the file exists; the file `variable` names instead, when set; None without `product`.

    Named by the version: another version's schema would fail the product's schema check.
    """
    if explicit := environ.get(variable):
        return Path(explicit)
    try:
        version = importlib.metadata.version(product)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(sys.prefix) / "share" / "ddpflow" / f"{product}-{version}.db"


def is_sqlite(path: Path) -> bool:
    """A readable SQLite file: a broken template must not become a store that cannot open."""
    try:
        with path.open("rb") as file:
            return file.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


def copy_into_place(template: Path, target: Path, folder_mode: int = 0o777) -> bool:
    """Copy `template` to `target` if there is no `target` yet; whether it was copied.

    Never replaces a database: the copy is written beside the target and linked into place,
    which fails if another process created one meanwhile. The file gets the permissions
    SQLite gives a database it creates (0666 less the umask); a folder made for it gets
    `folder_mode` (less the umask).
    """
    if target.exists() or not is_sqlite(template):
        return False
    partial = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        target.parent.mkdir(mode=folder_mode, parents=True, exist_ok=True)
        # Mode 0666 here: the kernel takes the umask off, as for a file SQLite creates.
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(descriptor, "wb") as copy, template.open("rb") as source:
            shutil.copyfileobj(source, copy)
        os.link(partial, target)
    except OSError:  # a database appeared, or the folder is not ours: the product makes its own
        return False
    finally:
        partial.unlink(missing_ok=True)
    return True


def vacuum_into(database: Path, target: Path) -> Path:
    """Write `database` to `target` as one self-contained file (a write-ahead log folded in),
    replacing `target` only once the whole file is written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(database)) as db:
        db.execute("VACUUM INTO ?", (str(partial),))
    os.replace(partial, target)
    return target
