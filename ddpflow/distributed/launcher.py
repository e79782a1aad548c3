"""The one launcher that owns DDP: one rank pinned per Dask worker, watched as a group.

It runs in the flow process (never inside a task holding a worker thread while it waits,
which would starve the rank pinned to that worker). Every call it makes to a worker is
bounded: a hung worker fails the launch, naming the worker, instead of blocking it.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import distributed

from ddpflow.distributed.context import RankSpec, cuda_available, process_group
from ddpflow.distributed.group_store import reserve_store_port
from ddpflow.distributed.planning import (
    RankAssignment,
    choose_backend,
    plan_ranks,
    workers_with_resources,
)
from ddpflow.distributed.progress import Subscriber, follow_progress, progress_topic
from ddpflow.distributed.reservation import reserve_workers
from ddpflow.distributed.supervisor.failures import FailureKind, LaunchError, RankFailure
from ddpflow.distributed.supervisor.graceful_stop import (
    GracefulNannyStop,
    GracefulStop,
    rank_running,
)
from ddpflow.distributed.supervisor.heartbeats import (
    StepWatch,
    ask_each,
    bind_thread,
    rank_started,
    unbind_thread,
)
from ddpflow.distributed.supervisor.stuck_ranks import release_stuck_ranks
from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION, SupervisionConfig
from ddpflow.distributed.supervisor.watch import (
    cluster_workers,
    started_event,
    wait_all_or_first_failure,
    wait_for_start,
)
from ddpflow.distributed.supervisor.wording import describe, words
from ddpflow.storage.redact import redacted_error

R = TypeVar("R")
log = logging.getLogger(__name__)
RANK_KEY_PREFIX = "ddp-rank"  # a rank task's Dask key: ddp-rank<rank>-<launch id>
__all__ = ["LaunchError", "RankFailure", "cluster_workers", "launch"]


def launch(
    client: distributed.Client,
    fn: Callable[..., R],
    *args: Any,
    world_size: int | None = None,
    timeout_s: float = 120.0,
    workers: Sequence[str] | None = None,
    reserve_wait_s: float = 3600.0,
    resources: Mapping[str, float] | None = None,
    subscribers: Sequence[Subscriber] = (),
    on_plan: Callable[[list[str]], None] | None = None,
    supervision: SupervisionConfig = DEFAULT_SUPERVISION,
) -> list[R]:
    """Run `fn(ctx, *args)` on `world_size` workers as one DDP group; results by rank.

    `timeout_s` bounds rank start-up, every collective (gloo/nccl) inside the group, and
    each rank's time without progress: from its group forming to its first
    `ctx.heartbeat()`, and between two heartbeats (fit() beats at every step).
    `workers` restricts the candidates (e.g. a sweep giving each trial its own workers).
    The group's workers are reserved cluster-wide first; while other groups hold them, the
    launch waits up to `reserve_wait_s` (it never starts ranks that would queue).
    `resources` (e.g. {"GPU": 1}) limits the candidates to workers that declare them, and
    each rank's task asks the scheduler for them too.
    `subscribers` each get every Progress event the ranks send (`ctx.report()` lines,
    ddpflow.fit's step counts), in order, in this process: the group's one progress topic
    is followed once and fanned out (ddpflow.distributed.progress). Training is otherwise
    silent in the flow's log.
    `on_plan` gets the group's worker addresses, by rank, before its ranks start (the grow
    watch of ddpflow.distributed.supervisor.growth asks exactly those to stop).
    `supervision`: the watch's poll intervals, question timeouts and grace periods.
    """
    # Once per cluster: a worker sent SIGTERM, retired or closed by its nanny makes its group
    # checkpoint at the next control step before it goes.
    client.register_plugin(GracefulStop(supervision))
    client.register_plugin(GracefulNannyStop(supervision))
    available: Mapping[str, Mapping[str, Any]]
    available = cluster_workers(client, supervision.scheduler_timeout_s)
    if workers is not None:
        missing = sorted(set(workers) - set(available))
        if missing:
            raise LaunchError(f"workers {missing} are not in the cluster", [])
        available = {addr: info for addr, info in available.items() if addr in workers}
    if resources:
        available = workers_with_resources(available, resources, world_size)
    size = len(plan_ranks(available, world_size))  # a world size the cluster cannot host fails now
    with reserve_workers(
        client, list(available), size, wait_s=reserve_wait_s, poll_s=supervision.reserve_poll_s
    ) as reserved:
        plan = plan_ranks({addr: available[addr] for addr in reserved}, size)
        if on_plan is not None:
            on_plan([a.worker_address for a in plan])
        return _run_group(client, fn, args, plan, timeout_s, supervision, resources, subscribers)


def _run_group(
    client: distributed.Client,
    fn: Callable[..., R],
    args: tuple,
    plan: list[RankAssignment],
    timeout_s: float,
    supervision: SupervisionConfig,
    resources: Mapping[str, float] | None = None,
    subscribers: Sequence[Subscriber] = (),
) -> list[R]:
    addresses = [a.worker_address for a in plan]
    ask_s = supervision.start_ask_timeout_s
    backend = choose_backend(_ask_all(client, plan, ask_s, cuda_available))
    rank0 = plan[0]
    port = _ask_all(client, plan[:1], ask_s, reserve_store_port, rank0.host)[rank0.worker_address]
    launch_id = uuid.uuid4().hex[:12]
    store_token = new_store_token()
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
        store_token=store_token,
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
            key=f"{RANK_KEY_PREFIX}{a.rank}-{launch_id}",
        )
        for a in plan
    ]
    finished = False
    watch = StepWatch(client, plan, launch_id, timeout_s, supervision.ask_timeout_s)
    topic = progress_topic(launch_id)
    try:
        with follow_progress(client, topic, subscribers, supervision.scheduler_timeout_s):
            wait_for_start(client, plan, futures, launch_id, timeout_s, supervision)
            wait_all_or_first_failure(client, plan, futures, watch, supervision)
        results = [f.result() for f in futures]
        finished = True
        return results
    except LaunchError as error:
        error.training_started = _training_started(client, plan, watch, supervision)
        raise
    finally:
        # A rank pinned to a dead worker stays pending forever unless cancelled.
        client.cancel([f for f in futures if not f.done()], force=True)
        if not finished:  # the next group must not wait for this one's stuck ranks
            # Our ranks' keys are strings (f"{RANK_KEY_PREFIX}..."); Dask types keys wider.
            keys = {a.worker_address: str(f.key) for a, f in zip(plan, futures, strict=True)}
            release_stuck_ranks(client, keys, supervision)


def new_store_token() -> str:
    """The secret that seals one group's store (group_store.py, sealed_store.py): 128
    random bits, made in this process. It reaches the ranks only as an argument of their
    tasks, over Dask's own channel, and is never logged."""
    return secrets.token_hex(16)


def _spec(
    a: RankAssignment,
    world: int,
    host: str,
    port: int,
    backend: str,
    timeout_s: float,
    launch_id: str,
    store_token: str,
) -> RankSpec:
    return RankSpec(
        a.rank,
        world,
        host,
        port,
        backend,
        timeout_s,
        launch_id,
        bind_host=a.host,
        store_token=store_token,
    )


def _rank_main(fn: Callable[..., R], spec: RankSpec, num_threads: int, args: tuple) -> R:
    """Runs on the pinned worker: signal start, size torch's thread pool, join the group."""
    import torch  # here: the launching (flow) process imports this module without torch

    _quiet_rank_failures()
    worker_client = distributed.get_client()  # the worker's own client
    rank_started(spec.launch_id, spec.rank)
    distributed.Event(started_event(spec.launch_id, spec.rank), client=worker_client).set()
    # One intra-op thread per worker thread: more oversubscribes the cores (30x slower).
    torch.set_num_threads(max(1, num_threads))
    with rank_running(), process_group(spec) as ctx:
        # The rendezvous may take up to the timeout by itself: the first step is due within
        # the timeout of the group forming.
        rank_started(spec.launch_id, spec.rank)
        bind_thread(spec.launch_id, spec.rank)
        # Who hosts each rank, for whoever watches, profiles or signals one (a progress line).
        ctx.report(
            f"rank {spec.rank} of {spec.world_size}: worker {distributed.get_worker().address}, "
            f"pid {os.getpid()}"
        )
        try:
            return fn(ctx, *args)
        except Exception as error:
            # Redacted here, before Dask keeps a copy for its dashboard and the launcher.
            safe = redacted_error(error)
            if safe is error:
                raise
            raise safe from None
        finally:
            unbind_thread()


def _ask_all(
    client: distributed.Client,
    plan: list[RankAssignment],
    timeout_s: float,
    fn: Callable[..., R],
    *args: Any,
) -> dict[str, R]:
    """`fn(*args)` on each rank's worker, bounded by `timeout_s`; a worker that does not
    answer fails the launch."""
    workers = [a.worker_address for a in plan]
    answers = ask_each(client, fn, *args, workers=workers, timeout_s=timeout_s)
    failures = [
        RankFailure(
            a.rank,
            a.worker_address,
            FailureKind.DID_NOT_START,
            words("no_answer", question=fn.__name__, timeout_s=timeout_s),
        )
        for a in plan
        if a.worker_address not in answers
    ]
    if failures:
        raise LaunchError(describe("group_could_not_start", failures), failures)
    return answers


def _training_started(
    client: distributed.Client,
    plan: list[RankAssignment],
    watch: StepWatch,
    supervision: SupervisionConfig,
) -> bool:
    """Whether any rank made a step: a last look catches ranks that stepped and then failed
    between two checks; a worker that is gone takes with it only what was seen before."""
    try:
        present = cluster_workers(client, supervision.scheduler_timeout_s)
        watch.refresh([a for a in plan if a.worker_address in present])
    except Exception as error:  # noqa: BLE001 - the group's own failure must come through
        log.warning("could not ask the workers whether training had started: %s", error)
    return watch.training_started


class _RankFailureRecord(logging.Filter):
    """Drops Dask's "Compute Failed" record of a rank task. The launcher names each rank's
    failure itself, root cause first; the worker's copy, an ERROR with a traceback that is
    often a peer's follow-on error ("Connection reset by peer"), only leads a reader astray."""

    def filter(self, record: logging.LogRecord) -> bool:
        key = record.args[0] if isinstance(record.args, tuple) and record.args else ""
        return not (
            str(record.msg).startswith("Compute Failed") and str(key).startswith(RANK_KEY_PREFIX)
        )


def _quiet_rank_failures() -> None:
    """Install _RankFailureRecord on this worker's logger, once per process."""
    worker_log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _RankFailureRecord) for f in worker_log.filters):
        worker_log.addFilter(_RankFailureRecord())
