"""Files that hold credentials: created with mode 0600 (folders 0700), never chmod-ed after.

A file created with the default umask and narrowed later is readable by every local user in
between; `os.open(..., mode)` creates it private, and a write through a fresh temporary name
plus `os.replace` means an existing file with looser bits is never written into.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path, fresh: bool = False) -> Path:
    """A folder only the owner can enter; `fresh` removes an old one (stale credentials) first."""
    path = Path(path)
    if fresh and path.exists():
        shutil.rmtree(path)
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return path


def write_private(path: Path, data: str | bytes) -> Path:
    """Write data to path atomically, the file being 0600 from its first byte."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    # O_EXCL: the temporary name is ours alone, so the mode given here is the file's mode.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
