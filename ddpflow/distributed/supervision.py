"""Watching a running rank group: it started, it progresses, its workers are there.

Each rank signals a Dask Event when it starts, so a rank that never starts is named
precisely instead of surfacing as an opaque "1/2 clients joined" store timeout on another
rank. While the group runs, a failed rank, a worker that left and a rank without step
progress each fail the whole group at once.
"""

from __future__ import annotations

import time
from typing import Any

import distributed

from ddpflow.distributed.failures import LaunchError, RankFailure, describe, root_causes_first
from ddpflow.distributed.leaving import left_cause, stopping_workers, wait_for_group_stop
from ddpflow.distributed.planning import RankAssignment
from ddpflow.distributed.watchdog import StepWatch
from ddpflow.storage.redact import error_text

POLL_S = 0.25
WORKER_CHECK_S = 1.0  # how often a running group checks its workers and ranks' progress
SCHEDULER_TIMEOUT_S = 30.0  # the scheduler answers in milliseconds unless it is gone
WORKER_LEFT = "its worker left the cluster (died or restarted)"
LOST_PEER_GRACE_S = 3.0
MAX_STALL_CHECK_S = 10.0


def stall_check_s(timeout_s: float) -> float:
    """How often the ranks' workers are asked for their progress: a twentieth of the timeout
    (a stall is named at most 5 % late), at least WORKER_CHECK_S, at most MAX_STALL_CHECK_S.
    Asking wakes the event loop of the rank's worker, which then takes the GIL from the
    rank: with the default 120 s timeout that is every 6 s instead of every second. Lost
    workers are looked for every WORKER_CHECK_S all the same (that asks the scheduler)."""
    return min(max(WORKER_CHECK_S, timeout_s / 20), MAX_STALL_CHECK_S)


def cluster_workers(client: distributed.Client) -> dict[str, dict[str, Any]]:
    """Every worker the scheduler has now: address -> info (nthreads, resources, name).

    Asks the scheduler each time. `Client.scheduler_info()` returns a cache instead, which
    the client's own periodic refresh replaces every 2 s with a copy that lists no workers,
    so a read that races the refresh sees an empty cluster.
    """
    identity = client.sync(
        client.scheduler.identity, n_workers=-1, callback_timeout=SCHEDULER_TIMEOUT_S
    )
    return dict(identity["workers"])


def started_event(launch_id: str, rank: int) -> str:
    return f"ddpflow-{launch_id}-rank{rank}-started"


def wait_for_start(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    launch_id: str,
    timeout_s: float,
) -> None:
    events = [distributed.Event(started_event(launch_id, a.rank), client=client) for a in plan]
    pending = set(range(len(plan)))
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        # With the client: a small group can train, lose a worker and fail on its peer's
        # "connection closed" before this loop has seen every start; the lost worker is
        # still the cause to name.
        _raise_on_failures(plan, futures, "failed while starting", client, since)
        pending = {r for r in pending if not events[r].is_set() and not futures[r].done()}
        if pending:
            time.sleep(POLL_S)
    if pending:
        failures = [
            RankFailure(
                r,
                plan[r].worker_address,
                f"did not start within {timeout_s:g}s (task state: {futures[r].status}; "
                "the worker is busy, gone or overloaded)",
            )
            for r in sorted(pending)
        ]
        raise LaunchError(describe("could not start", failures), failures)


def wait_all_or_first_failure(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    watch: StepWatch,
) -> None:
    # Polls the futures' local state: distributed.wait/as_completed would need a default
    # client, and Prefect's client deliberately is not one.
    since = time.time()  # a worker's stop notices from before this group are not about it
    next_check = time.monotonic() + WORKER_CHECK_S
    stall_every = stall_check_s(watch.timeout_s)
    next_stall_check = time.monotonic() + stall_every
    while not all(f.done() for f in futures):
        _raise_on_failures(plan, futures, "failed", client, since)
        now = time.monotonic()
        if now >= next_check:
            _raise_on_lost_workers(client, plan, futures, since)
            next_check = now + WORKER_CHECK_S
        if now >= next_stall_check:
            running = [a for a, f in zip(plan, futures, strict=True) if not f.done()]
            if stalled := watch.stalled(running):
                _raise_on_failures(plan, futures, "failed")  # a rank's own error comes first
                raise LaunchError(describe("stalled", stalled), stalled)
            next_stall_check = time.monotonic() + stall_every
        time.sleep(POLL_S)
    _raise_on_failures(plan, futures, "failed", client, since)


def _raise_on_lost_workers(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    since: float,
) -> None:
    """A rank whose worker left the cluster never finishes: Dask keeps its pinned task
    waiting for that worker. With peers, their collectives fail; a group of one, or one
    whose peers are done, would wait forever without this check.

    A worker asked to leave (`retire_workers`) first stops its rank at the group's next
    control step (ddpflow.distributed.leaving): the group is waited for, so that the
    relaunch starts from that step's checkpoint, and the cause names the stop."""
    current = cluster_workers(client)
    gone = [a.worker_address not in current for a in plan]
    left = [a for a, f, g in zip(plan, futures, gone, strict=True) if g and not f.done()]
    if not left:
        return
    stopping = stopping_workers(client, [a.worker_address for a in left], since)
    if stopping:
        wait_for_group_stop(client, futures, [not g for g in gone], stopping, since)
    failures = [
        RankFailure(a.rank, a.worker_address, left_cause(a.worker_address, stopping, WORKER_LEFT))
        for a in left
    ]
    failures += [
        RankFailure(a.rank, a.worker_address, _cause(f))
        for a, f in zip(plan, futures, strict=True)
        if a not in left and f.status in ("error", "cancelled", "lost")
    ]
    failures = root_causes_first(failures)
    raise LaunchError(describe("stopped" if stopping else "failed", failures), failures)


def _raise_on_failures(
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    verb: str,
    client: distributed.Client | None = None,
    since: float = 0.0,
) -> None:
    failures = _failed_ranks(plan, futures)
    if failures:
        if client is not None:
            lost = _lost_peers(client, plan, futures, since)
            # A peer whose own error arrived meanwhile is named by it (a stopping rank's
            # StopRequested comes milliseconds after its peer's, and its worker then goes).
            failures = _failed_ranks(plan, futures)
            failed = {f.rank for f in failures}
            failures = root_causes_first(failures + [f for f in lost if f.rank not in failed])
        raise LaunchError(describe(verb, failures), failures)


def _failed_ranks(
    plan: list[RankAssignment], futures: list[distributed.Future]
) -> list[RankFailure]:
    return [
        RankFailure(a.rank, a.worker_address, _cause(f))
        for a, f in zip(plan, futures, strict=True)
        if f.status in ("error", "cancelled", "lost")
    ]


def _lost_peers(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    since: float,
) -> list[RankFailure]:
    """The other ranks whose worker is gone. A killed worker's peer fails first, with a
    "connection reset" naming no one; the dead worker is what the user needs to know.

    The peer's error can reach us before the scheduler has dropped the dead worker, so
    this looks again for up to LOST_PEER_GRACE_S: a short delay on a failure that a
    restart takes many seconds to heal anyway.
    """
    deadline = time.monotonic() + LOST_PEER_GRACE_S
    while others := [a for a, f in zip(plan, futures, strict=True) if not f.done()]:
        try:
            current = cluster_workers(client)
        except Exception:  # noqa: BLE001 - the group's own failure must come through
            return []
        lost = [a for a in others if a.worker_address not in current]
        if lost or time.monotonic() >= deadline:
            # A peer that stopped at a leaver's request (StopRequested) comes in first.
            addresses = [a.worker_address for a in lost]
            stopping = stopping_workers(client, addresses, since, notice_s=0) if lost else {}
            return [
                RankFailure(a.rank, a.worker_address, left_cause(addr, stopping, WORKER_LEFT))
                for a, addr in zip(lost, addresses, strict=True)
            ]
        time.sleep(POLL_S)
    return []


def _cause(future: distributed.Future) -> str:
    if future.status != "error":
        return f"task {future.status}"
    # Redacted here, where a rank's error first becomes text: the cause goes on into the
    # LaunchError's message, the restarts tag and artifact, logs and the flow's state, and
    # a library's message may quote a URL with its credentials (MLflow's names the
    # tracking URI, user:password@ included).
    return error_text(future.exception())
