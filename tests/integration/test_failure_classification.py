"""A rank's exception is classified by what torch 2.14 really raises (supervisor/classify.py):
a two-rank gloo group, set up as the launcher's are (bound gloo, the sealed group store), in
which one rank is SIGKILLed, hangs (SIGSTOP), raises, or is killed while its peer waits for
its checkpoint (the store it serves goes with it). Each surviving rank's exception is only a
follow-on of its peer's failure; the rank that raised is the root."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time

import pytest

from ddpflow.distributed.context import find_free_port
from ddpflow.distributed.supervisor.classify import classify
from ddpflow.distributed.supervisor.failures import FailureKind
from tests.helpers.failing_ranks import run_rank

pytestmark = pytest.mark.integration

TIMEOUT_S = 3.0  # the group's collective timeout: a hung peer is noticed after it
WAIT_S = 60.0  # two spawned processes import torch and meet, on a loaded machine


def _exceptions(failure: str, victim: int, expected: int) -> dict[int, BaseException]:
    """The exceptions the group's ranks caught, by rank (the test's `expected` of them)."""
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    port = find_free_port()
    ranks = [
        spawn.Process(target=run_rank, args=(r, port, failure, victim, TIMEOUT_S, out))
        for r in range(2)
    ]
    for process in ranks:
        process.start()
    caught: dict[int, BaseException] = {}
    deadline = time.monotonic() + WAIT_S
    try:
        while len(caught) < expected and time.monotonic() < deadline:
            try:
                rank, error = out.get(timeout=1)
            except queue.Empty:
                continue
            caught[rank] = error
    finally:
        for process in ranks:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGCONT)  # a stopped process ends only once resumed
                process.kill()
            process.join(10)
    return caught


@pytest.mark.parametrize(
    ("failure", "victim"),
    [("killed", 1), ("killed", 0), ("hung", 1)],
)
def test_a_peer_killed_or_hung_is_a_follow_on_for_the_survivor(failure: str, victim: int):
    survivor = 1 - victim
    caught = _exceptions(failure, victim, expected=1)
    assert set(caught) == {survivor}, caught
    error = caught[survivor]
    # What torch 2.14 raises here: gloo's RuntimeError ("Connection reset by peer",
    # "Timed out waiting ... for recv"), or the store's DistNetworkError where the victim
    # served it; either is the peer's failure reaching this rank.
    assert classify(error) is FailureKind.FOLLOW_ON, f"{type(error).__name__}: {error}"


def test_a_rank_that_raises_is_the_root_and_its_peer_follows():
    caught = _exceptions("raised", victim=1, expected=2)
    assert isinstance(caught[1], ValueError)
    assert classify(caught[1]) is FailureKind.RAISED
    assert classify(caught[0]) is FailureKind.FOLLOW_ON, f"{type(caught[0]).__name__}: {caught[0]}"


def test_the_store_gone_with_rank_0_is_a_follow_on_by_its_torch_type():
    import torch.distributed as dist

    caught = _exceptions("killed-in-checkpoint", victim=0, expected=1)
    assert isinstance(caught[1], dist.DistNetworkError), f"{type(caught[1])}: {caught[1]}"
    assert classify(caught[1]) is FailureKind.FOLLOW_ON
