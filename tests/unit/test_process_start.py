"""A service's process is told from a later one with its pid by when it started
(infra.procs.process_start), and a step of the system clock must not change that: after one
of about a minute in a full test run, each stop() found "another process" under its
service's pid, signalled nothing and left an MLflow server running. The step is simulated
on this test's own process by moving the boot time psutil reads (what a clock step does to
/proc/stat's btime)."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from infra.procs import pid_alive, process_start, same_start

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's btime")


def test_a_clock_step_leaves_a_process_itself(monkeypatch):
    recorded = process_start(psutil.Process())
    before = psutil.Process().create_time()
    stepped = psutil._psplatform.boot_time() + 59.0
    monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: stepped)
    assert psutil.Process().create_time() - before == pytest.approx(59.0, abs=1.5), "stepped"
    assert same_start(recorded, psutil.Process())
    assert pid_alive(os.getpid(), recorded)


def test_another_start_under_the_same_pid_is_another_process():
    recorded = process_start(psutil.Process())
    assert not pid_alive(os.getpid(), recorded - 1.0)
    assert not same_start(recorded + 0.5, psutil.Process())
