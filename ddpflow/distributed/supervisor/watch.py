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

from ddpflow.distributed.planning import RankAssignment
from ddpflow.distributed.supervisor.classify import classify
from ddpflow.distributed.supervisor.failures import (
    FailureKind,
    LaunchError,
    RankFailure,
    root_causes_first,
)
from ddpflow.distributed.supervisor.heartbeats import StepWatch
from ddpflow.distributed.supervisor.leaving import (
    left_failure,
    stopping_workers,
    wait_for_group_stop,
)
from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION, SupervisionConfig
from ddpflow.distributed.supervisor.wording import describe, words
from ddpflow.storage.redact import error_text


def stall_check_s(timeout_s: float, timings: SupervisionConfig = DEFAULT_SUPERVISION) -> float:
    """How often the ranks' workers are asked for their progress: a twentieth of the timeout
    (a stall is named at most 5 % late), at least timings.worker_check_s, at most
    timings.max_stall_check_s. Asking wakes the event loop of the rank's worker, which then
    takes the GIL from the rank: with the default 120 s timeout that is every 6 s instead of
    every second. Lost workers are looked for every worker_check_s all the same (that asks
    the scheduler)."""
    return min(max(timings.worker_check_s, timeout_s / 20), timings.max_stall_check_s)


def cluster_workers(
    client: distributed.Client, timeout_s: float = DEFAULT_SUPERVISION.scheduler_timeout_s
) -> dict[str, dict[str, Any]]:
    """Every worker the scheduler has now: address -> info (nthreads, resources, name).

    Asks the scheduler each time. `Client.scheduler_info()` returns a cache instead, which
    the client's own periodic refresh replaces every 2 s with a copy that lists no workers,
    so a read that races the refresh sees an empty cluster.
    """
    assert client.scheduler is not None  # a connected client has its scheduler's handle
    identity = client.sync(client.scheduler.identity, n_workers=-1, callback_timeout=timeout_s)
    return dict(identity["workers"])


def started_event(launch_id: str, rank: int) -> str:
    return f"ddpflow-{launch_id}-rank{rank}-started"


def wait_for_start(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    launch_id: str,
    timeout_s: float,
    timings: SupervisionConfig = DEFAULT_SUPERVISION,
) -> None:
    events = [distributed.Event(started_event(launch_id, a.rank), client=client) for a in plan]
    pending = set(range(len(plan)))
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        # With the client: a small group can train, lose a worker and fail on its peer's
        # "connection closed" before this loop has seen every start; the lost worker is
        # still the cause to name.
        _raise_on_failures(plan, futures, "group_failed_while_starting", timings, client, since)
        pending = {r for r in pending if not events[r].is_set() and not futures[r].done()}
        if pending:
            time.sleep(timings.poll_s)
    if pending:
        failures = [
            RankFailure(
                r,
                plan[r].worker_address,
                FailureKind.DID_NOT_START,
                words("not_started", timeout_s=timeout_s, status=futures[r].status),
            )
            for r in sorted(pending)
        ]
        raise LaunchError(describe("group_could_not_start", failures), failures)


def wait_all_or_first_failure(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    watch: StepWatch,
    timings: SupervisionConfig = DEFAULT_SUPERVISION,
) -> None:
    # Polls the futures' local state: distributed.wait/as_completed would need a default
    # client, and Prefect's client deliberately is not one.
    since = time.time()  # a worker's stop notices from before this group are not about it
    next_check = time.monotonic() + timings.worker_check_s
    stall_every = stall_check_s(watch.timeout_s, timings)
    next_stall_check = time.monotonic() + stall_every
    while not all(f.done() for f in futures):
        _raise_on_failures(plan, futures, "group_failed", timings, client, since)
        now = time.monotonic()
        if now >= next_check:
            _raise_on_lost_workers(client, plan, futures, since, timings)
            next_check = now + timings.worker_check_s
        if now >= next_stall_check:
            running = [a for a, f in zip(plan, futures, strict=True) if not f.done()]
            if stalled := watch.stalled(running):
                # A rank's own error comes first.
                _raise_on_failures(plan, futures, "group_failed", timings)
                raise LaunchError(describe("group_stalled", stalled), stalled)
            next_stall_check = time.monotonic() + stall_every
        time.sleep(timings.poll_s)
    _raise_on_failures(plan, futures, "group_failed", timings, client, since)


def _raise_on_lost_workers(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    since: float,
    timings: SupervisionConfig,
) -> None:
    """A rank whose worker left the cluster never finishes: Dask keeps its pinned task
    waiting for that worker. With peers, their collectives fail; a group of one, or one
    whose peers are done, would wait forever without this check.

    A worker asked to leave (`retire_workers`) first stops its rank at the group's next
    control step (ddpflow.distributed.supervisor.leaving): the group is waited for, so that the
    relaunch starts from that step's checkpoint, and the cause names the stop."""
    current = cluster_workers(client, timings.scheduler_timeout_s)
    gone = [a.worker_address not in current for a in plan]
    left = [a for a, f, g in zip(plan, futures, gone, strict=True) if g and not f.done()]
    if not left:
        return
    stopping = stopping_workers(client, [a.worker_address for a in left], since, timings)
    if stopping:
        wait_for_group_stop(client, futures, [not g for g in gone], stopping, since, timings)
    failures = [left_failure(a.rank, a.worker_address, stopping) for a in left]
    failures += [
        rank_failure(a, f)
        for a, f in zip(plan, futures, strict=True)
        if a not in left and f.status in ("error", "cancelled", "lost")
    ]
    failures = root_causes_first(failures)
    outcome = "group_stopped" if stopping else "group_failed"
    raise LaunchError(describe(outcome, failures), failures)


def _raise_on_failures(
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    outcome: str,
    timings: SupervisionConfig,
    client: distributed.Client | None = None,
    since: float = 0.0,
) -> None:
    failures = _failed_ranks(plan, futures)
    if failures:
        if client is not None:
            lost = _lost_peers(client, plan, futures, since, timings)
            # A peer whose own error arrived meanwhile is named by it (a stopping rank's
            # StopRequested comes milliseconds after its peer's, and its worker then goes).
            failures = _failed_ranks(plan, futures)
            failed = {f.rank for f in failures}
            failures = root_causes_first(failures + [f for f in lost if f.rank not in failed])
        raise LaunchError(describe(outcome, failures), failures)


def _failed_ranks(
    plan: list[RankAssignment], futures: list[distributed.Future]
) -> list[RankFailure]:
    return [
        rank_failure(a, f)
        for a, f in zip(plan, futures, strict=True)
        if f.status in ("error", "cancelled", "lost")
    ]


def _lost_peers(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    since: float,
    timings: SupervisionConfig,
) -> list[RankFailure]:
    """The other ranks whose worker is gone. A killed worker's peer fails first, with a
    "connection reset" naming no one; the dead worker is what the user needs to know.

    The peer's error can reach us before the scheduler has dropped the dead worker, so
    this looks again for up to timings.lost_peer_grace_s: a short delay on a failure that
    a restart takes many seconds to heal anyway.
    """
    deadline = time.monotonic() + timings.lost_peer_grace_s
    while others := [a for a, f in zip(plan, futures, strict=True) if not f.done()]:
        try:
            current = cluster_workers(client, timings.scheduler_timeout_s)
        except Exception:  # noqa: BLE001 - the group's own failure must come through
            return []
        lost = [a for a in others if a.worker_address not in current]
        if lost or time.monotonic() >= deadline:
            # A peer that stopped at a leaver's request (StopRequested) comes in first.
            addresses = [a.worker_address for a in lost]
            stopping = (
                stopping_workers(client, addresses, since, timings, wait=False) if lost else {}
            )
            return [left_failure(a.rank, a.worker_address, stopping) for a in lost]
        time.sleep(timings.poll_s)
    return []


def rank_failure(assignment: RankAssignment, future: distributed.Future) -> RankFailure:
    """The failure of a rank whose task ended without a result: classified here, once, where
    the launcher reads its exception."""
    rank, worker = assignment.rank, assignment.worker_address
    if future.status != "error":
        # Cancelled (by the launcher, after another rank failed) or lost with its worker.
        kind = FailureKind.WORKER_LOST if future.status == "lost" else FailureKind.FOLLOW_ON
        return RankFailure(rank, worker, kind, words("task_status", status=future.status))
    error = future.exception()
    # Redacted here, where a rank's error first becomes text: the cause goes on into the
    # LaunchError's message, the restarts tag and artifact, logs and the flow's state, and
    # a library's message may quote a URL with its credentials (MLflow's names the
    # tracking URI, user:password@ included).
    cause = words("raised", error=error_text(error))
    raised = f"{type(error).__module__}.{type(error).__qualname__}"
    return RankFailure(rank, worker, classify(error), cause, raised)
