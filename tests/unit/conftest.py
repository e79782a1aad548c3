"""tests/unit starts no process and no server: a test that tries fails at once, naming the
rule. Such a test belongs in tests/integration (marked `integration`), where the suite
expects the cost and the scheduler groups it (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing.process
import platform
import socket
import subprocess
from collections.abc import Iterator

import pytest

RULE = "tests/unit starts no process or server: move this test to tests/integration"

# platform.processor() runs `uname -p` once per interpreter and caches the answer; MLflow's
# server app calls it when imported. Asked here, before any test, that one-off probe of the
# machine is not counted as a test starting a process (a unit test alone failed on it).
platform.processor()


class StartsAProcessOrServer(AssertionError):
    pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise StartsAProcessOrServer(RULE)


@pytest.fixture(autouse=True)
def no_process_or_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
    monkeypatch.setattr(socket.socket, "listen", _refuse)
    yield
