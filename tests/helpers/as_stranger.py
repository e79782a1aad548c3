"""Run a short script as another local user (`nobody`), for the tests of what such a user
can reach: root, setpriv and the system Python are needed, which CI has (outside CI the
test is skipped, on CI it fails)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

STRANGER_UID = 65534  # nobody
SYSTEM_PYTHON = Path("/usr/bin/python3")


def require_stranger() -> None:
    """Skip (fail on CI) where a process cannot be started as `nobody`."""
    if not (os.geteuid() == 0 and shutil.which("setpriv") and SYSTEM_PYTHON.is_file()):
        if os.environ.get("CI"):
            pytest.fail("CI runs as root with setpriv and /usr/bin/python3: the probe must run")
        pytest.skip("needs root, setpriv and /usr/bin/python3 to run a request as another user")


def run_as_stranger(script: str, *args: str, timeout_s: float = 90) -> str:
    """`script`'s stdout, run by the system Python as `nobody` with `args` as its argv,
    from / with a bare environment (nothing of this process's credentials)."""
    require_stranger()
    done = subprocess.run(
        ["setpriv", f"--reuid={STRANGER_UID}", f"--regid={STRANGER_UID}", "--clear-groups",
         str(SYSTEM_PYTHON), "-c", script, *args],
        cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout
