"""Worker reservations (ddpflow/distributed/reservation.py) on a real LocalCluster.

Two launches that want the same workers, as two flow runs sharing one cluster do: without
the reservation the second group's ranks would be pinned to busy workers and queue in Dask
(or fail at the rank timeout). These tests watch the reservation itself (the second launch
announces that it waits, and none of its ranks starts before the first group lets go), so
they fail when the locks are gone even though Dask happens to queue the tasks in order.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import distributed
import pytest

from ddpflow.distributed import cluster_workers, launch
from ddpflow.distributed.reservation import ReservationTimeout, reserve_workers
from tests.helpers.rank_functions import hold_until, started_at

pytestmark = pytest.mark.integration
WAITING = "waiting for 2 free workers"


@contextmanager
def first_group_holding(client: distributed.Client) -> Iterator[dict]:
    """A 2-rank group that holds both workers until the block ends (or its `release` is
    called); yields {"release": fn, "released_at": time.time() of the release}."""
    holding, release = (f"ddpflow-test-{name}-{uuid.uuid4().hex}" for name in ("on", "off"))
    state: dict = {}

    def let_go() -> None:
        if "released_at" not in state:
            state["released_at"] = time.time()
            distributed.Event(release, client=client).set()

    state["release"] = let_go
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            launch, client, hold_until, holding, release, world_size=2, timeout_s=60
        )
        try:
            formed = distributed.Event(holding, client=client).wait(120)
            assert formed, first.exception(0) if first.done() else "the first group never formed"
            yield state
        finally:
            let_go()  # also when the test failed: the first group must end
        state["first_let_go"] = min(first.result(timeout=120))


def wait_for_log(caplog: pytest.LogCaptureFixture, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"no log line {text!r} within {timeout_s:g}s"
        time.sleep(0.05)


# docs/deployments.md "Concurrency": a second DDP group waits until the first
# group's workers are free instead of queueing ranks that would time out.
def test_a_second_group_waits_until_the_first_releases_its_workers(dask_client, caplog):
    caplog.set_level(logging.WARNING, logger="ddpflow.distributed.reservation")
    with ThreadPoolExecutor(1) as pool, first_group_holding(dask_client) as first:
        second = pool.submit(
            launch, dask_client, started_at, world_size=2, timeout_s=60, reserve_wait_s=300
        )
        wait_for_log(caplog, WAITING)
        assert not second.done(), "the second group ran while the first held its workers"
        first["release"]()
        starts = second.result(timeout=120)
    assert min(starts) >= first["released_at"], "a rank of the second group started early"


def test_a_group_whose_workers_stay_busy_fails_after_reserve_wait_s(dask_client):
    with first_group_holding(dask_client):
        started = time.monotonic()
        with pytest.raises(
            ReservationTimeout,
            match=r"2 of the workers \[.+\] were not free within 2s \(other DDP groups hold them\)",
        ):
            launch(dask_client, started_at, world_size=2, timeout_s=60, reserve_wait_s=2)
        waited = time.monotonic() - started
    assert waited >= 2, f"gave up after {waited:.1f}s, before reserve_wait_s"
    assert waited < 60, f"took {waited:.1f}s to give up"


def test_a_waiting_reservation_holds_no_worker_meanwhile(dask_client, caplog):
    """A group of 2 that finds only one worker free does not sit on that one while it
    waits: a group of 1 gets it (else two half-served groups could block each other)."""
    caplog.set_level(logging.WARNING, logger="ddpflow.distributed.reservation")
    workers = sorted(cluster_workers(dask_client))

    def wants_two() -> list[str]:
        with reserve_workers(dask_client, workers, 2, wait_s=120, poll_s=0.05) as held:
            return held

    with ThreadPoolExecutor(1) as pool:
        with reserve_workers(dask_client, workers, 1) as first:
            assert first == workers[:1], "the lowest address first"
            pair = pool.submit(wants_two)
            wait_for_log(caplog, WAITING)  # the pair tried, found one worker, and waits
            with reserve_workers(dask_client, workers, 1, wait_s=10, poll_s=0.05) as second:
                assert second == workers[1:]
                assert not pair.done(), "the pair got both workers while they were held"
        assert sorted(pair.result(timeout=60)) == workers, "and gets both once they are free"
