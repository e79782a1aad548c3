"""A benchmark stopped with SIGTERM (`timeout`, a job scheduler) still runs its `finally`
blocks, where it stops the servers, clusters and flows it started."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BENCH = """
import sys, time
from pathlib import Path
from bench.common import stop_cleanly_on_sigterm

stop_cleanly_on_sigterm()
marker = Path(sys.argv[1])
try:
    marker.write_text("started")
    time.sleep(60)
finally:
    marker.write_text("services stopped")
"""


def test_sigterm_runs_the_benchmarks_finally_blocks(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", BENCH, str(marker)], cwd=REPO)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the bench did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "services stopped"
