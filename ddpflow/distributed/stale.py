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

from ddpflow.distributed.supervision import cluster_workers

log = logging.getLogger(__name__)
GRACE_S = 3.0  # a rank that raised returns within milliseconds; a stuck one never does
ASK_TIMEOUT_S = 5.0  # a worker cut off from the network does not answer at all
REPLACE_TIMEOUT_S = 30.0  # a nanny's fresh worker registers in seconds (it imports torch)


def release_stuck_ranks(
    client: distributed.Client,
    rank_keys: Mapping[str, str],
    grace_s: float = GRACE_S,
) -> list[str]:
    """End each worker (address -> its rank's task key) still running its rank after
    `grace_s`, then wait (bounded) until the scheduler has dropped them and as many workers
    as before are back, so the next plan neither uses a dead address nor runs short;
    returns the ended workers' addresses.

    Workers that do not answer are left alone here: the restarts' healing step handles
    unresponsive workers, and one that left the cluster runs nothing.
    """
    deadline = time.monotonic() + grace_s
    # A worker that left runs nothing here, and asking it would take ASK_TIMEOUT_S: Dask
    # retries a refused connection until its connect timeout.
    present = _workers(client)
    stuck = _still_running(client, {w: k for w, k in rank_keys.items() if w in present})
    while stuck and time.monotonic() < deadline:
        time.sleep(0.25)
        stuck = _still_running(client, {w: rank_keys[w] for w in stuck})
    if stuck:
        log.warning("ending workers %s: a rank of the failed group still runs there", stuck)
        num_before = len(_workers(client))
        try:
            client.run(_exit_soon, workers=stuck, on_error="return", callback_timeout=ASK_TIMEOUT_S)
        except TimeoutError:  # a worker that stopped answering: the healing step restarts it
            log.warning("workers %s did not answer within %gs", stuck, ASK_TIMEOUT_S)
        _wait_replaced(client, stuck, num_before)
    return stuck


def _wait_replaced(client: distributed.Client, ended: list[str], num_before: int) -> None:
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    while time.monotonic() < deadline:
        current = _workers(client)
        if not set(ended) & current and len(current) >= num_before:
            return
        time.sleep(0.2)
    log.warning("workers %s were not replaced within %gs", ended, REPLACE_TIMEOUT_S)


def _workers(client: distributed.Client) -> set[str]:
    return set(cluster_workers(client))


def _still_running(client: distributed.Client, rank_keys: Mapping[str, str]) -> list[str]:
    if not rank_keys:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(rank_keys))
    try:
        asks = {
            worker: pool.submit(client.run, _runs_key, key, workers=[worker], on_error="return")
            for worker, key in rank_keys.items()
        }
        concurrent.futures.wait(asks.values(), timeout=ASK_TIMEOUT_S)
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
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()


def _runs_key(key: str, dask_worker: distributed.Worker) -> bool:
    """On the worker: is the task `key` still executing in one of its threads?"""
    return key in dask_worker.active_keys
