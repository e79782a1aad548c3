"""Free the workers of a failed group: a rank still running there would block the next one.

Cancelling a Dask task does not stop its thread. A rank stuck in the rendezvous or in a
collective (its peers failed or were cut off) keeps its worker's only thread until the
process-group timeout, so a relaunch pinned to that worker would wait that long to start.
After a short grace, for ranks that are merely finishing their error handling, the worker
processes that still run one of the group's ranks end at once (SIGKILL): their nannies start
fresh ones within seconds, as after any crash. A graceful nanny restart would first wait
seconds for a thread that cannot stop (it is inside gloo's C++ code), then kill it anyway.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

import distributed

from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION, SupervisionConfig
from ddpflow.distributed.supervisor.watch import cluster_workers

log = logging.getLogger(__name__)
# An ended worker answers its last question before it goes.
EXIT_DELAY_S = 0.2


def release_stuck_ranks(
    client: distributed.Client,
    rank_keys: Mapping[str, str],
    timings: SupervisionConfig = DEFAULT_SUPERVISION,
) -> list[str]:
    """End each worker (address -> its rank's task key) still running its rank after
    timings.stuck_grace_s, then wait (bounded) until the scheduler has dropped them and as
    many workers as before are back, so the next plan neither uses a dead address nor runs
    short; returns the ended workers' addresses.

    Workers that do not answer are left alone here: the restarts' healing step handles
    unresponsive workers, and one that left the cluster runs nothing.
    """
    deadline = time.monotonic() + timings.stuck_grace_s
    # A worker that left runs nothing here, and asking it would take the ask timeout: Dask
    # retries a refused connection until its connect timeout.
    present = _workers(client, timings)
    stuck = _still_running(client, {w: k for w, k in rank_keys.items() if w in present}, timings)
    while stuck and time.monotonic() < deadline:
        time.sleep(timings.poll_s)
        stuck = _still_running(client, {w: rank_keys[w] for w in stuck}, timings)
    if stuck:
        log.warning("ending workers %s: a rank of the failed group still runs there", stuck)
        num_before = len(_workers(client, timings))
        ask_s = timings.ask_timeout_s
        try:
            client.run(_exit_soon, workers=stuck, on_error="return", callback_timeout=ask_s)
        except TimeoutError:  # a worker that stopped answering: the healing step restarts it
            log.warning("workers %s did not answer within %gs", stuck, ask_s)
        _wait_replaced(client, stuck, num_before, timings)
    return stuck


def _wait_replaced(
    client: distributed.Client, ended: list[str], num_before: int, timings: SupervisionConfig
) -> None:
    deadline = time.monotonic() + timings.replace_timeout_s
    while time.monotonic() < deadline:
        current = _workers(client, timings)
        if not set(ended) & current and len(current) >= num_before:
            return
        time.sleep(timings.poll_s)
    log.warning("workers %s were not replaced within %gs", ended, timings.replace_timeout_s)


def _workers(client: distributed.Client, timings: SupervisionConfig) -> set[str]:
    return set(cluster_workers(client, timings.scheduler_timeout_s))


def _still_running(
    client: distributed.Client, rank_keys: Mapping[str, str], timings: SupervisionConfig
) -> list[str]:
    if not rank_keys:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(rank_keys))
    try:
        asks = {
            worker: pool.submit(client.run, _runs_key, key, workers=[worker], on_error="return")
            for worker, key in rank_keys.items()
        }
        concurrent.futures.wait(asks.values(), timeout=timings.ask_timeout_s)
        return sorted(w for w, ask in asks.items() if _answer(ask, w) is True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _answer(ask: concurrent.futures.Future, worker: str) -> bool | None:
    if not ask.done() or ask.exception() is not None:
        return None
    value = ask.result().get(worker)
    return value if isinstance(value, bool) else None


def _exit_soon() -> None:
    """On the worker: end this process right after answering (its nanny starts a new one)."""
    threading.Timer(EXIT_DELAY_S, os.kill, (os.getpid(), signal.SIGKILL)).start()


def _runs_key(key: str, dask_worker: distributed.Worker) -> bool:
    """On the worker: is the task `key` still executing in one of its threads?"""
    return key in dask_worker.active_keys
