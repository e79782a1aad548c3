"""The launcher and a worker asked to leave through Dask, in seconds: a LocalCluster of three
worker processes, a 2-rank group of steps_until_asked (fit()'s stop check without a model),
and `retire_workers` or a nanny closing under one rank. The spare worker lets the relaunch
start at once, so these tests see whether the launcher waited for the group to stop."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import distributed
import pytest

from ddpflow.cluster.build import local_cluster
from ddpflow.distributed.supervisor.relaunch import Restart, launch_with_restarts
from tests.helpers.leave_ranks import CONTROL_EVERY, steps_until_asked

pytestmark = pytest.mark.integration
# Asked just past a control step, the group stops about 2 s later, at the next one: after the
# launcher's once-a-second look at its workers has seen the retired one gone.
STEPS, STEP_S = 60, 0.1
ASK_AFTER = CONTROL_EVERY + 1


@pytest.fixture
def cluster() -> Iterator[tuple[distributed.LocalCluster, distributed.Client]]:
    with local_cluster(3) as lc, distributed.Client(lc) as client:
        client.wait_for_workers(3, timeout=120)
        yield lc, client


def start_group(
    client: distributed.Client, state: Path
) -> concurrent.futures.Future[tuple[list[int], list[Restart]]]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    args = (str(state), STEPS, STEP_S)
    done = pool.submit(
        launch_with_restarts, client, steps_until_asked, *args, world_size=2, timeout_s=60,
        max_restarts=1,
    )  # fmt: skip
    pool.shutdown(wait=False)
    return done


def step_of(state: Path, rank: int) -> int:
    path = state / f"rank{rank}-step"
    return int(path.read_text() or 0) if path.exists() else 0


def worker_of(state: Path, rank: int, after_step: int = ASK_AFTER) -> tuple[str, int]:
    """Once the group has made some steps: `rank`'s worker address, and its step now."""
    deadline = time.monotonic() + 120
    while step_of(state, rank) < after_step:
        assert time.monotonic() < deadline, "the group made no steps"
        time.sleep(0.05)
    return (state / f"rank{rank}-worker").read_text(), step_of(state, rank)


def assert_stopped_at_the_next_control_step(
    state: Path, asked_at: int, results: list[int], restarts: list[Restart]
) -> str:
    stopped = int((state / "stopped-at").read_text())
    print(f"asked at step {asked_at}, stopped at step {stopped}; cause: {restarts[0].cause}")
    assert stopped % CONTROL_EVERY == 0 and asked_at <= stopped <= asked_at + 2 * CONTROL_EVERY
    assert results == [stopped, stopped], "the relaunch resumed from the stop's step"
    (restart,) = restarts
    return restart.cause


# docs/fault-tolerance.md: after retire_workers the launcher waits for the group to stop at the
# next control step, names the stop as the cause, and relaunches from that step.
def test_retire_workers_stops_the_group_and_the_launcher_waits_for_it(cluster, tmp_path):
    _, client = cluster
    group = start_group(client, tmp_path)
    address, asked_at = worker_of(tmp_path, 1)
    assert address in client.retire_workers([address])
    results, restarts = group.result(timeout=120)
    cause = assert_stopped_at_the_next_control_step(tmp_path, asked_at, results, restarts)
    stopped = results[0]
    assert f"worker {address} asked to stop (its worker is closing" in cause
    assert "it stopped its rank and left the cluster" in cause
    # The peer's own StopRequested is part of the cause: the launcher waited for it, although
    # the retired worker had left the cluster about 2 s before.
    peer = (
        f"another worker of the group was asked to stop; the group checkpointed at step {stopped}"
    )
    assert peer in cause, cause


# docs/fault-tolerance.md: a nanny closing (SIGTERM to `dask worker`) stops its worker's ranks
# first; the rank's own StopRequested names the nanny.
def test_a_closing_nanny_stops_the_group_before_it_closes_its_worker(cluster, tmp_path):
    lc, client = cluster
    group = start_group(client, tmp_path)
    address, asked_at = worker_of(tmp_path, 0)
    (nanny,) = [n for n in lc.workers.values() if n.worker_address == address]
    lc.sync(nanny.close, timeout=10, reason="test")
    results, restarts = group.result(timeout=120)
    cause = assert_stopped_at_the_next_control_step(tmp_path, asked_at, results, restarts)
    assert f"worker {address} asked to stop (its nanny is closing" in cause
