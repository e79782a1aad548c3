"""The one launcher that owns DDP: one rank pinned per Dask worker, watched as a group.

It runs in the flow process (never inside a task holding a worker thread while it waits,
which would starve the rank pinned to that worker). Each rank signals a Dask Event when it
starts, so a rank that never starts is named precisely instead of surfacing as an opaque
"1/2 clients joined" store timeout on another rank.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import distributed
import torch

from ddpflow.distributed.context import (
    RankSpec,
    cuda_available,
    find_free_port,
    process_group,
    progress_topic,
)
from ddpflow.distributed.planning import (
    RankAssignment,
    choose_backend,
    plan_ranks,
    workers_with_resources,
)
from ddpflow.distributed.progress import follow_progress
from ddpflow.distributed.reservation import reserve_workers
from ddpflow.distributed.stale import release_stuck_ranks

R = TypeVar("R")
log = logging.getLogger(__name__)
POLL_S = 0.25
WORKER_CHECK_S = 1.0  # how often a running group checks that its workers are still there


@dataclass(frozen=True)
class RankFailure:
    rank: int
    worker_address: str
    cause: str


def cluster_workers(client: distributed.Client) -> dict[str, dict[str, Any]]:
    """Every worker the scheduler has now: address -> info (nthreads, resources, name).

    Asks the scheduler each time. `Client.scheduler_info()` returns a cache instead, which
    the client's own periodic refresh replaces every 2 s with a copy that lists no workers,
    so a read that races the refresh sees an empty cluster.
    """
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


class LaunchError(RuntimeError):
    """A rank group failed; `failures` names each failed rank, its worker and the cause."""

    def __init__(self, message: str, failures: Sequence[RankFailure]):
        super().__init__(message)
        self.failures = list(failures)


def launch(
    client: distributed.Client,
    fn: Callable[..., R],
    *args: Any,
    world_size: int | None = None,
    timeout_s: float = 120.0,
    workers: Sequence[str] | None = None,
    reserve_wait_s: float = 3600.0,
    resources: Mapping[str, float] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> list[R]:
    """Run `fn(ctx, *args)` on `world_size` workers as one DDP group; results by rank.

    `timeout_s` bounds rank start-up and every collective (gloo/nccl) inside the group.
    `workers` restricts the candidates (e.g. a sweep giving each trial its own workers).
    The group's workers are reserved cluster-wide first; while other groups hold them, the
    launch waits up to `reserve_wait_s` (it never starts ranks that would queue).
    `resources` (e.g. {"GPU": 1}) limits the candidates to workers that declare them, and
    each rank's task asks the scheduler for them too.
    `on_progress` gets each line a rank sends with `ctx.report()`, in order, in this process
    (e.g. the flow's run logger): training is otherwise silent in the flow's log.
    """
    available = cluster_workers(client)
    if workers is not None:
        missing = sorted(set(workers) - set(available))
        if missing:
            raise LaunchError(f"workers {missing} are not in the cluster", [])
        available = {addr: info for addr, info in available.items() if addr in workers}
    if resources:
        available = workers_with_resources(available, resources, world_size)
    size = len(plan_ranks(available, world_size))  # a world size the cluster cannot host fails now
    with reserve_workers(client, list(available), size, wait_s=reserve_wait_s) as reserved:
        plan = plan_ranks({addr: available[addr] for addr in reserved}, size)
        return _run_group(client, fn, args, plan, timeout_s, resources, on_progress)


def _run_group(
    client: distributed.Client,
    fn: Callable[..., R],
    args: tuple,
    plan: list[RankAssignment],
    timeout_s: float,
    resources: Mapping[str, float] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> list[R]:
    addresses = [a.worker_address for a in plan]
    backend = choose_backend(client.run(cuda_available, workers=addresses))
    rank0 = plan[0]
    port = client.run(find_free_port, workers=[rank0.worker_address])[rank0.worker_address]
    launch_id = uuid.uuid4().hex[:12]
    log.info(
        "launching %d ranks (%s) on %s, rendezvous %s:%s",
        len(plan),
        backend,
        addresses,
        rank0.host,
        port,
    )
    spec_for = functools.partial(
        _spec,
        world=len(plan),
        host=rank0.host,
        port=port,
        backend=backend,
        timeout_s=timeout_s,
        launch_id=launch_id,
    )
    futures = [
        client.submit(
            _rank_main,
            fn,
            spec_for(a),
            a.num_threads,
            args,
            workers=[a.worker_address],
            allow_other_workers=False,
            resources=dict(resources) if resources else None,
            pure=False,
            key=f"ddp-rank{a.rank}-{launch_id}",
        )
        for a in plan
    ]
    finished = False
    try:
        with follow_progress(client, progress_topic(launch_id), on_progress):
            _wait_for_start(client, plan, futures, launch_id, timeout_s)
            _wait_all_or_first_failure(client, plan, futures)
        results = [f.result() for f in futures]
        finished = True
        return results
    finally:
        # A rank pinned to a dead worker stays pending forever unless cancelled.
        client.cancel([f for f in futures if not f.done()], force=True)
        if not finished:  # the next group must not wait for this one's stuck ranks
            release_stuck_ranks(
                client, {a.worker_address: f.key for a, f in zip(plan, futures, strict=True)}
            )


def _spec(
    a: RankAssignment,
    world: int,
    host: str,
    port: int,
    backend: str,
    timeout_s: float,
    launch_id: str,
) -> RankSpec:
    return RankSpec(a.rank, world, host, port, backend, timeout_s, launch_id, bind_host=a.host)


def _started_event(launch_id: str, rank: int) -> str:
    return f"ddpflow-{launch_id}-rank{rank}-started"


def _rank_main(fn: Callable[..., R], spec: RankSpec, num_threads: int, args: tuple) -> R:
    """Runs on the pinned worker: signal start, size torch's thread pool, join the group."""
    worker_client = distributed.get_client()  # the worker's own client
    distributed.Event(_started_event(spec.launch_id, spec.rank), client=worker_client).set()
    # One intra-op thread per worker thread: more oversubscribes the cores (30x slower).
    torch.set_num_threads(max(1, num_threads))
    with process_group(spec) as ctx:
        return fn(ctx, *args)


def _wait_for_start(
    client: distributed.Client,
    plan: list[RankAssignment],
    futures: list[distributed.Future],
    launch_id: str,
    timeout_s: float,
) -> None:
    events = [distributed.Event(_started_event(launch_id, a.rank), client=client) for a in plan]
    pending = set(range(len(plan)))
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        _raise_on_failures(plan, futures, "failed while starting")
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
        raise LaunchError(_describe("could not start", failures), failures)


def _wait_all_or_first_failure(
    client: distributed.Client, plan: list[RankAssignment], futures: list[distributed.Future]
) -> None:
    # Polls the futures' local state: distributed.wait/as_completed would need a default
    # client, and Prefect's client deliberately is not one.
    next_check = time.monotonic() + WORKER_CHECK_S
    while not all(f.done() for f in futures):
        _raise_on_failures(plan, futures, "failed")
        if time.monotonic() >= next_check:
            _raise_on_lost_workers(client, plan, futures)
            next_check = time.monotonic() + WORKER_CHECK_S
        time.sleep(POLL_S)
    _raise_on_failures(plan, futures, "failed")


def _raise_on_lost_workers(
    client: distributed.Client, plan: list[RankAssignment], futures: list[distributed.Future]
) -> None:
    """A rank whose worker left the cluster never finishes: Dask keeps its pinned task
    waiting for that worker. With peers, their collectives fail; a group of one, or one
    whose peers are done, would wait forever without this check."""
    current = cluster_workers(client)
    failures = [
        RankFailure(a.rank, a.worker_address, "its worker left the cluster (died or restarted)")
        for a, f in zip(plan, futures, strict=True)
        if not f.done() and a.worker_address not in current
    ]
    if failures:
        raise LaunchError(_describe("failed", failures), failures)


def _raise_on_failures(
    plan: list[RankAssignment], futures: list[distributed.Future], verb: str
) -> None:
    failures = [
        RankFailure(a.rank, a.worker_address, _cause(f))
        for a, f in zip(plan, futures, strict=True)
        if f.status in ("error", "cancelled", "lost")
    ]
    if failures:
        raise LaunchError(_describe(verb, failures), failures)


def _cause(future: distributed.Future) -> str:
    if future.status != "error":
        return f"task {future.status}"
    error = future.exception()
    return f"{type(error).__name__}: {error}"


def _describe(verb: str, failures: Sequence[RankFailure]) -> str:
    lines = [f"rank {f.rank} on worker {f.worker_address}: {f.cause}" for f in failures]
    return f"DDP group {verb}: " + "; ".join(lines)
