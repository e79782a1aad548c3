"""The SIGTERM handler of ddpflow.distributed.supervisor.graceful_stop, in a real child process
that sends itself the signal: it exits at once without a rank, and only after its rank is done
with one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.integration

CHILD = """
import os, signal, sys, threading, time
from ddpflow.distributed.supervisor import graceful_stop

from ddpflow.distributed.supervisor.timings import SupervisionConfig

timings = SupervisionConfig(grace_s={grace}, result_delay_s=0.0)
assert graceful_stop.install("tcp://w:1", timings)
rank_seconds = {rank_seconds}
done = threading.Event()

def rank():
    with graceful_stop.rank_running():
        time.sleep(rank_seconds)
        print("reason:", graceful_stop.stop_reason(), flush=True)
    done.set()

if rank_seconds:
    threading.Thread(target=rank).start()
    time.sleep(0.2)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("still alive", flush=True)
"""


def run_child(rank_seconds: float, grace: float = 20.0) -> tuple[int, str, float]:
    started = time.monotonic()
    code = textwrap.dedent(CHILD.format(grace=grace, rank_seconds=rank_seconds))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


# docs/fault-tolerance.md: a worker process that runs no rank exits at once on SIGTERM.
def test_without_a_rank_sigterm_ends_the_process_at_once():
    code, output, _ = run_child(rank_seconds=0)
    assert code == 128 + 15, output
    assert "still alive" not in output


# docs/fault-tolerance.md: with a rank, the process asks it to stop and exits once it is done.
def test_with_a_rank_the_process_exits_once_the_rank_is_done():
    code, output, took = run_child(rank_seconds=2)
    assert code == 128 + 15, output
    assert "reason: worker tcp://w:1 asked to stop (SIGTERM)" in output, output
    assert took < 15, "it did not wait for the grace period"


def test_a_rank_that_does_not_stop_is_left_after_the_grace_period():
    code, output, took = run_child(rank_seconds=25, grace=1)
    assert code == 128 + 15, output
    assert "reason:" not in output, "the process went before the rank was done"
    assert took < 15
