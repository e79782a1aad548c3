"""The Dask worker's periodic jobs, switched in running workers and nannies (client.run).

bench/worker_overhead.py measures each variant; the functions here run on the workers, so
they live in a module the workers import by name.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import distributed
from tornado.ioloop import PeriodicCallback

# Periodic jobs by their key in Server.periodic_callbacks (distributed/core.py, worker.py,
# worker_memory.py); (worker's, nanny's). Heartbeats and keep-alive are never switched off:
# without them the scheduler drops the worker.
JOBS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "event-loop tick (20 ms)": (("tick", "ticks"), ("tick", "ticks")),
    "system monitor (500 ms)": (("monitor",), ("monitor",)),
    "memory monitor (100 ms)": (("memory_monitor",), ("memory_monitor",)),
}
# Also switched off in ALL_OFF; too rare (1 s) to measure on its own.
RARE_JOBS = (("find-missing",), ())
ALL_OFF = "all of the above off"
PROFILER_ON = "sampling profiler on (10 ms)"
# ddpflow.cluster.workers.WORKER_CONFIG's intervals (ms), in workers and nannies alike.
DDPFLOW = "ddpflow's intervals (1 s, 2 s, 1 s)"
DDPFLOW_MS = {"tick": 1000, "monitor": 2000, "memory_monitor": 1000}
VARIANTS = ["dask defaults", *JOBS, ALL_OFF, PROFILER_ON, DDPFLOW]


def switch_jobs(names: tuple[str, ...], on: bool, dask_worker: Any) -> None:
    for name in names:
        callback = dask_worker.periodic_callbacks.get(name)
        if callback is not None:
            callback.start() if on else callback.stop()


def profiler(on: bool, dask_worker: Any) -> None:
    """Dask's sampling profiler as `distributed.worker.profile.enabled` starts it."""
    jobs = {
        "bench-profile": (dask_worker.trigger_profile, 10),
        "bench-profile-cycle": (dask_worker.cycle_profile, 1000),
    }
    for name, (fn, ms) in jobs.items():
        if on:
            dask_worker.periodic_callbacks[name] = PeriodicCallback(fn, ms)
            dask_worker.periodic_callbacks[name].start()
        else:
            dask_worker.periodic_callbacks.pop(name).stop()


def set_intervals(ms: dict[str, float], dask_worker: Any) -> dict[str, float]:
    """Set the jobs' intervals; returns the ones they had."""
    before = {}
    for name, interval in ms.items():
        if (callback := dask_worker.periodic_callbacks.get(name)) is not None:
            before[name], callback.callback_time = callback.callback_time, interval
    return before


def _loop_cpu_s() -> float:
    """CPU seconds of the calling thread: client.run calls this on the event loop's thread."""
    return time.thread_time()


def _process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def overhead_cpu_s(client: distributed.Client) -> tuple[float, float]:
    """CPU seconds so far of the workers' event-loop threads and of this process, which
    holds the scheduler and the nannies of a LocalCluster (as a flow's process does)."""
    loops = sum(client.run(_loop_cpu_s).values())
    nannies = sum(client.run(_process_cpu_s, nanny=True).values())
    return loops, nannies


def variant_switch(client: distributed.Client, variant: str) -> Callable[[bool], None]:
    """on(True) puts the variant in place, on(False) restores the defaults."""
    if variant == PROFILER_ON:
        return lambda on: client.run(profiler, on)
    if variant == DDPFLOW:  # the same before in every worker and nanny: Dask's defaults
        saved: list[dict[str, float]] = []

        def interval(place: bool) -> None:
            for nanny in (False, True):
                ms = DDPFLOW_MS if place else saved[nanny]
                answers = client.run(set_intervals, ms, nanny=nanny)
                if place:
                    saved.append(next(iter(answers.values())))

        return interval
    picked = [*JOBS.values(), RARE_JOBS] if variant == ALL_OFF else [JOBS[variant]]
    worker_jobs = tuple(n for w, _ in picked for n in w)
    nanny_jobs = tuple(n for _, n in picked for n in n)

    def apply(place: bool) -> None:
        client.run(switch_jobs, worker_jobs, not place)
        client.run(switch_jobs, nanny_jobs, not place, nanny=True)

    return apply
