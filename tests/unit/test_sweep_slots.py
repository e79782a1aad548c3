"""The worker-slot scheduler: never more trials at once than the workers hold; others queue."""

from __future__ import annotations

import threading

import pytest

from ddpflow.workloads.sweep.slots import WorkerSlots, run_queued

WORKERS = ["tcp://127.0.0.1:4003", "tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002"]


def test_acquire_hands_out_lowest_addresses_and_release_returns_them() -> None:
    slots = WorkerSlots(WORKERS)
    first = slots.acquire(2)
    assert first == ["tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002"]
    assert slots.num_free == 1
    slots.release(first)
    assert slots.num_free == 3


def test_acquire_waits_until_enough_workers_are_free() -> None:
    slots = WorkerSlots(WORKERS)
    held = slots.acquire(2)
    with pytest.raises(TimeoutError, match="no 2 free workers within 0.05s"):
        slots.acquire(2, timeout_s=0.05)
    # Released while the acquire below waits; the bound is generous for a loaded machine.
    threading.Timer(0.05, slots.release, args=(held,)).start()
    assert len(slots.acquire(2, timeout_s=60)) == 2


@pytest.mark.parametrize("k", [0, 4])
def test_a_trial_larger_than_the_cluster_is_refused(k: int) -> None:
    with pytest.raises(ValueError, match="cannot fit"):
        WorkerSlots(WORKERS).acquire(k)


def test_releasing_workers_not_held_is_an_error() -> None:
    slots = WorkerSlots(WORKERS)
    with pytest.raises(ValueError, match="not held"):
        slots.release(["tcp://127.0.0.1:4001"])
    with pytest.raises(ValueError, match="not held"):
        slots.release(["tcp://10.0.0.1:1"])


def test_max_concurrent_is_whole_groups_only() -> None:
    slots = WorkerSlots(WORKERS)
    assert [slots.max_concurrent(k) for k in (1, 2, 3)] == [3, 1, 1]


class Cluster:
    """The worker list a scheduler would report; tests change it as workers die and return."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = list(workers)

    def __call__(self) -> list[str]:
        return list(self.workers)


def test_a_worker_restarted_at_a_new_address_replaces_the_old_one() -> None:
    """Worker 4001 dies while held; its nanny brings it back as 4009. The old address is
    never handed out again, the new one is, and releasing the old one is not an error."""
    cluster = Cluster(WORKERS)
    slots = WorkerSlots(WORKERS, current=cluster)
    held = slots.acquire(1)
    assert held == ["tcp://127.0.0.1:4001"]
    cluster.workers = ["tcp://127.0.0.1:4002", "tcp://127.0.0.1:4003", "tcp://127.0.0.1:4009"]
    slots.release(held)
    assert sorted(slots.acquire(3)) == sorted(cluster.workers)


def test_a_trial_waits_for_a_lost_worker_to_come_back() -> None:
    cluster = Cluster(WORKERS[:1])  # two of three are gone, restarting
    slots = WorkerSlots(WORKERS, current=cluster)
    with pytest.raises(TimeoutError, match="no 2 free workers within 0.1s"):
        slots.acquire(2, timeout_s=0.1)
    threading.Timer(0.1, lambda: cluster.workers.append("tcp://127.0.0.1:4009")).start()
    assert slots.acquire(2, timeout_s=60) == ["tcp://127.0.0.1:4003", "tcp://127.0.0.1:4009"]


class Recorder:
    """Counts trials running at once and which workers each one saw. The first `together`
    items wait for each other before they finish, so the peak is reached however slowly
    the threads start (no timing involved)."""

    def __init__(self, together: int) -> None:
        self.lock = threading.Lock()
        self.running: set[str] = set()
        self.peak = 0
        self.overlaps: list[str] = []
        self.together = threading.Barrier(together, timeout=30)

    def __call__(self, item: int, workers: list[str]) -> tuple[int, list[str]]:
        with self.lock:
            clash = self.running & set(workers)
            if clash:
                self.overlaps.append(f"item {item} got busy workers {clash}")
            self.running |= set(workers)
            self.peak = max(self.peak, len(self.running))
        if item < self.together.parties:
            self.together.wait()
        with self.lock:
            self.running -= set(workers)
        return item, workers


@pytest.mark.parametrize(("k", "expected_peak"), [(1, 3), (2, 2), (3, 3)])
def test_run_queued_never_over_assigns_and_runs_every_item(k: int, expected_peak: int) -> None:
    recorder = Recorder(together=len(WORKERS) // k)
    results = run_queued(list(range(10)), WorkerSlots(WORKERS), k, recorder)
    assert [item for item, _ in results] == list(range(10)), "results in item order"
    assert all(len(workers) == k for _, workers in results)
    assert recorder.overlaps == []
    assert recorder.peak <= len(WORKERS)
    assert recorder.peak == expected_peak  # k=2 fits once on 3 workers: 2 workers busy


def test_run_queued_queues_beyond_capacity() -> None:
    # The first two must run at the same time (else the barrier breaks); the others wait.
    both_running = threading.Barrier(2, timeout=30)
    later_started = threading.Event()
    lock = threading.Lock()
    log: list[tuple[str, int]] = []

    def fn(item: int, workers: list[str]) -> int:
        if item < 2:
            both_running.wait()
        with lock:
            log.append(("start", item))
        if item >= 2:
            later_started.set()
        else:
            # Give a queued item that (wrongly) starts now every chance to show up first.
            later_started.wait(0.5)
        with lock:
            log.append(("end", item))
        return item

    assert run_queued([0, 1, 2, 3], WorkerSlots(WORKERS[:2]), 1, fn) == [0, 1, 2, 3]
    first_end = next(i for i, (event, _) in enumerate(log) if event == "end")
    assert log.index(("start", 2)) > first_end, log
    assert log.index(("start", 3)) > first_end, log


def test_run_queued_sees_the_callers_context_variables() -> None:
    import contextvars

    flow_name: contextvars.ContextVar[str] = contextvars.ContextVar("flow_name")
    flow_name.set("sweep")
    seen = run_queued([0, 1], WorkerSlots(WORKERS), 1, lambda item, w: flow_name.get())
    assert seen == ["sweep", "sweep"]


def test_an_escaping_error_is_raised_after_the_other_items_finish() -> None:
    finished: list[int] = []

    def fn(item: int, workers: list[str]) -> int:
        if item == 0:
            raise RuntimeError("boom")
        finished.append(item)
        return item

    with pytest.raises(RuntimeError, match="boom"):
        run_queued([0, 1, 2], WorkerSlots(WORKERS[:1]), 1, fn)
    assert sorted(finished) == [1, 2]
