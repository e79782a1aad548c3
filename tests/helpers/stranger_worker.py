"""Another local user (`nobody`) against a flow's Dask scheduler: a plain tcp:// client that
asks the scheduler for its uid, and a `dask worker` of its own that tries to join.

Started with `setpriv` as uid/gid 65534 and no groups, from / with a bare environment (none
of this process's credentials), by the system Python with a world-readable copy of the
venv's Dask on its path: an attacker needs any Dask, and this one is ours. Needs root,
setpriv and the system Python of the venv's version; outside CI a missing one skips the
test, on CI (which has them) it fails, so a test that never ran cannot pass.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.as_stranger import STRANGER_UID
from tests.helpers.as_stranger import require_stranger as require_setpriv

SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
# Prints "refused: ..." when no connection to the scheduler came about, else what it ran.
PLAIN_CLIENT = r"""
import os, sys
import distributed
try:
    with distributed.Client(sys.argv[1], timeout=3) as client:
        print(f"REACHED: run_on_scheduler(os.getuid) gave {client.run_on_scheduler(os.getuid)}")
except Exception as error:
    print(f"refused: {type(error).__name__}: {error}"[:300])
"""


def _argv(*args: str) -> list[str]:
    return ["setpriv", f"--reuid={STRANGER_UID}", f"--regid={STRANGER_UID}", "--clear-groups",
            str(SYSTEM_PYTHON), *args]  # fmt: skip


def _env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(readable_packages("distributed"))}


@functools.cache
def readable_packages(*roots: str) -> Path:
    """A world-readable copy of the venv's `roots` (e.g. distributed) and all they require.

    `nobody` may not be able to enter the checkout (a clone under /root, mode 0700), so the
    venv itself is no use to it: the few pure-Python and small compiled packages a Dask
    client and worker need (a few MB, not torch) are copied into a temporary folder it can
    read, removed when the test process exits."""
    target = Path(tempfile.mkdtemp(prefix="ddpflow-stranger-dask-"))
    atexit.register(shutil.rmtree, target, True)
    seen: set[str] = set()
    wanted = list(roots)
    while wanted:
        name = canonicalize_name(wanted.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this venv lacks
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
        for file in dist.files or ():
            source = Path(dist.locate_file(file))
            if source.is_file():
                copy = target / file
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, copy)
    for folder, _, _ in os.walk(target):
        os.chmod(folder, 0o755)
    os.chmod(target, 0o755)
    return target


def require_stranger() -> None:
    """Skip (fail on CI) where `nobody` cannot run a Dask client and worker."""
    require_setpriv()
    reason = None
    if not SYSTEM_PYTHON.is_file():
        reason = f"needs {SYSTEM_PYTHON}, the venv's Python version, to run Dask as another user"
    else:
        probe = subprocess.run(
            _argv("-c", "import distributed"), env=_env(), cwd="/", capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        if probe.returncode != 0:
            reason = f"nobody cannot import the copied distributed: {probe.stderr[-300:]}"
    if reason and os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI runs as root with setpriv and the system Python: {reason}")
    if reason:
        pytest.skip(reason)


def plain_tcp_client(address: str) -> str:
    """What a client of `nobody` got from `address` (tcp://HOST:PORT)."""
    done = subprocess.run(
        _argv("-c", PLAIN_CLIENT, address), env=_env(), cwd="/", capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


class StrangerWorker:
    """`dask worker ADDRESS --name stranger` run by `nobody`, until stop(); its log on disk."""

    NAME = "stranger"

    def __init__(self, address: str) -> None:
        # Its scratch folder and log: a folder of its own (the shared temp folder's
        # dask-scratch-space may be another user's).
        self.home = Path(tempfile.mkdtemp(prefix="ddpflow-stranger-"))
        os.chown(self.home, STRANGER_UID, STRANGER_UID)
        self.log = self.home / "worker.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                _argv("-m", "distributed.cli.dask_worker", address, "--name", self.NAME,
                      "--nthreads", "1", "--no-nanny", "--no-dashboard", "--death-timeout",
                      "600", "--local-directory", str(self.home)),
                env=_env(), cwd="/", stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text()

    def stop(self) -> str:
        """Stop the worker (ours, by its pid); its whole log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        text = self.text()
        shutil.rmtree(self.home, ignore_errors=True)
        return text
