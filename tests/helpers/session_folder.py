"""A folder made once per test session, whichever pytest-xdist process asks for it first."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def session_folder(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """The folder `name`, filled by `make(folder)` once per test session: the first process
    to ask makes it, under a lock in the folder that the processes' own temporary folders
    share, and the others wait for it and use the same one. So the modules that use it need
    not run on one process. A `make` that raises leaves no finished folder: the next process
    to ask makes it anew."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-N, above each process's popen-gwN
    folder, finished = root / name, root / f"{name}.finished"
    with FileLock(str(root / f"{name}.lock")):
        if not finished.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            finished.touch()
    return folder
