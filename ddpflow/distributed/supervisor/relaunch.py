"""Restarts: a failed rank group is healed and relaunched, up to `max_restarts` times.

A rank group fails as a whole. A worker process that dies makes its peers' collectives fail
in well under a second (gloo: "connection reset"), and a hung worker (e.g. SIGSTOP) makes them
fail at the collective timeout. The launcher then cancels every rank future, including one
pinned to a dead worker, which Dask would otherwise keep pending forever. Here the cluster is
healed before the next attempt:
- a worker that no longer answers a ping is restarted through its nanny;
- a worker that died comes back from its nanny at a new address;
- the next attempt waits until enough workers are registered.

The rank function resumes from the latest complete checkpoint by itself. Each attempt plans
its ranks anew on the workers that exist now.

A failure that repeats the previous attempt's before any rank made a training step (a model
that cannot be built, out of memory at the first step) is deterministic: it is raised at
once instead of spending the remaining restarts on it.

With `max_workers`, the group is elastic both ways: it starts with the workers there are (at
least `min_workers`), a relaunch after a loss goes on with those that are left, and workers
that join and stay `settle_s` make it grow (growth.py): the group stops at a step checkpoint
and is relaunched larger, which is not a failure and spends no restart.
Every change of the world size is reported to `on_resize` as a `Resize`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import distributed

from ddpflow.config import DEFAULT_SETTLE_S
from ddpflow.distributed.launcher import LaunchError, cluster_workers, launch
from ddpflow.distributed.progress import Subscriber
from ddpflow.distributed.supervisor.growth import GrowWatch
from ddpflow.distributed.supervisor.policy import Action, Signature, decide
from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION, SupervisionConfig
from ddpflow.distributed.supervisor.wording import words

R = TypeVar("R")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restart:
    """One restart: why the group failed and what was done about it."""

    attempt: int
    cause: str
    failed_ranks: list[str]
    restarted_workers: list[str]  # unresponsive (hung) workers ddpflow restarted itself
    world_size: int | None  # None: every worker the cluster had (no world_size asked)
    heal_s: float
    # The cluster's workers that were gone when the group relaunched, and those that had
    # joined since the failed attempt started (a nanny's replacement for a killed worker
    # has a new address; so does an autoscaler's new node), whoever restarted them.
    lost_workers: list[str] = field(default_factory=list)
    new_workers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Resize:
    """One change of the group's world size, and why: "joined" (workers joined and stayed:
    a grow, not a failure), "lost" (workers died or hung and were not back in time) or
    "preempted" (workers were asked to leave: SIGTERM, retire_workers, a closing nanny)."""

    old_size: int
    new_size: int
    reason: str
    workers: list[str]  # those that joined, or those that were lost


class RestartsExhausted(LaunchError):
    """The group failed once more than `max_restarts` allows."""


class WorkersNotBack(LaunchError):
    """After a failure, too few workers came back to relaunch the group."""

    def __init__(self, message: str):
        super().__init__(message, [])


class RepeatedFailure(RestartsExhausted):
    """The group failed twice in a row the same way before training started."""


def launch_with_restarts(
    client: distributed.Client,
    fn: Callable[..., R],
    *args: Any,
    world_size: int | None = None,
    min_workers: int | None = None,
    max_workers: int | None = None,
    settle_s: float = DEFAULT_SETTLE_S,
    timeout_s: float = 120.0,
    max_restarts: int = 2,
    heal_timeout_s: float = 120.0,
    on_restart: Callable[[Restart], None] | None = None,
    on_resize: Callable[[Resize], None] | None = None,
    resources: Mapping[str, float] | None = None,
    subscribers: Sequence[Subscriber] = (),
    supervision: SupervisionConfig = DEFAULT_SUPERVISION,
) -> tuple[list[R], list[Restart]]:
    """launch() with healing and relaunch on failure; returns the results and the restarts.

    `min_workers` (default: the world size) lets a relaunch continue with fewer ranks when
    workers do not come back: each rank still takes `batch_size` samples per step, so the
    global batch shrinks with the world size while the learning rate stays as configured.
    `max_workers` makes the group elastic both ways (this module's docstring); `world_size`
    is then the size to start at (default: the workers there are, up to `max_workers`, once
    `min_workers` of them are).
    `subscribers` are handed to every attempt's launch: one that spans the attempts (a
    progress artifact) sees the whole training.
    `supervision`: the watch's poll intervals, question timeouts and grace periods, for
    every attempt and for healing between them.
    """
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts} must be >= 0")
    check_world_bounds(world_size, min_workers, max_workers)
    if max_workers is not None:
        check_settle(settle_s)
    restarts: list[Restart] = []
    size = world_size
    if max_workers is not None and world_size is None:
        size = _elastic_size(
            client, None, min_workers, max_workers, 0.0, heal_timeout_s, supervision
        )
    # The last attempt's failures, if it failed before a training step (policy.Decision).
    before_training: frozenset[Signature] = frozenset()
    while True:
        known = set(cluster_workers(client, supervision.scheduler_timeout_s))
        planned: list[str] = []
        watch = (
            GrowWatch(client, max_workers, settle_s, resources, timings=supervision)
            if max_workers is not None
            else None
        )

        def on_plan(
            workers: list[str], planned: list[str] = planned, watch: GrowWatch | None = watch
        ) -> None:
            planned[:] = workers
            if watch is not None:
                watch.start(workers)

        try:
            results = launch(
                client,
                fn,
                *args,
                world_size=size,
                timeout_s=timeout_s,
                resources=resources,
                subscribers=subscribers,
                on_plan=on_plan,
                supervision=supervision,
            )
            return results, restarts
        except LaunchError as error:
            decision = decide(
                error,
                grow_asked=watch is not None and watch.target is not None,
                previous=before_training,
                restarts_used=len(restarts),
                max_restarts=max_restarts,
            )
            if decision.action is Action.GROW:
                assert watch is not None and max_workers is not None  # grow_asked
                size = min(max_workers, max(len(watch.usable()), 1))
                log.warning("the group grows from %d to %d ranks", len(planned), size)
                if on_resize is not None:
                    on_resize(Resize(len(planned), size, decision.resize_reason, watch.joined))
                before_training = frozenset()
                continue  # the `finally` clears the grow's stop request before the relaunch
            attempt = len(restarts) + 1
            if decision.action is Action.GIVE_UP_REPEATED:
                assert decision.repeated is not None
                raise RepeatedFailure(
                    f"{error} (attempts {attempt - 1} and {attempt} failed the same way before "
                    "training started, so restarting will not help; fix the cause: "
                    f"{decision.repeated.cause})",
                    error.failures,
                ) from error
            before_training = decision.signatures
            if decision.action is Action.GIVE_UP_EXHAUSTED:
                raise RestartsExhausted(
                    f"{error} (no restart left: max_restarts={max_restarts}, {len(restarts)} used)",
                    error.failures,
                ) from error
            failed = [
                words("rank_cause", rank=f.rank, worker=f.worker_address, cause=f.cause)
                for f in error.failures
            ]
            log.warning("DDP group failed (%s); healing the cluster and restarting", error)
            started = time.monotonic()
            _wait_for_leavers(client, decision.leavers, supervision)
            restarted = heal(client, heal_timeout_s, supervision)
            if max_workers is None:
                size = _next_world_size(
                    client, world_size, min_workers, heal_timeout_s, supervision
                )
            else:
                floor = min_workers if min_workers is not None else world_size
                size = _elastic_size(
                    client, len(planned), floor, max_workers, settle_s, heal_timeout_s, supervision
                )
            now = set(cluster_workers(client, supervision.scheduler_timeout_s))
            restart = Restart(
                attempt=attempt,
                # Redacted already: a rank's error becomes text only through
                # watch.rank_failure, which redacts it.
                cause=str(error),
                failed_ranks=failed,
                restarted_workers=restarted,
                world_size=size,
                heal_s=time.monotonic() - started,
                lost_workers=sorted(known - now),
                new_workers=sorted(now - known),
            )
            restarts.append(restart)
            if on_restart is not None:
                on_restart(restart)
            if on_resize is not None and planned and size is not None and size != len(planned):
                resize = Resize(len(planned), size, decision.resize_reason, restart.lost_workers)
                on_resize(resize)
        finally:
            if watch is not None:
                watch.close()


def check_world_bounds(world_size: object, min_workers: object, max_workers: object) -> None:
    """ValueError naming the bad value and the fix, before any work (ddpflow.run and the
    flows' parameters check with this one definition)."""
    for name, value in (
        ("world_size", world_size),
        ("min_workers", min_workers),
        ("max_workers", max_workers),
    ):
        bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
        if value is not None and bad:
            raise ValueError(f"{name}={value!r}: pass a whole number of ranks >= 1, or None")
    if None not in (min_workers, world_size) and min_workers > world_size:  # type: ignore[operator]
        raise ValueError(
            f"min_workers={min_workers} is more than world_size={world_size}; "
            "lower min_workers or raise world_size"
        )
    if max_workers is None:
        return
    for name, value in (("world_size", world_size), ("min_workers", min_workers)):
        if value is not None and value > max_workers:  # type: ignore[operator]
            raise ValueError(
                f"{name}={value} is more than max_workers={max_workers}; raise max_workers "
                f"(the most ranks the group may grow to) or lower {name}"
            )


def _wait_for_leavers(
    client: distributed.Client, leavers: Sequence[str], timings: SupervisionConfig
) -> None:
    """Wait until the workers asked to leave (SIGTERM, their nanny closing, retired) are gone:
    each closes once its rank has stopped (graceful_stop.py), and a relaunch that took it
    again would fail when it does."""
    leaving = set(leavers)
    deadline = time.monotonic() + timings.leave_wait_s
    while leaving & set(cluster_workers(client, timings.scheduler_timeout_s)):
        if time.monotonic() >= deadline:
            return
        time.sleep(timings.poll_s)


def heal(
    client: distributed.Client, timeout_s: float, timings: SupervisionConfig = DEFAULT_SUPERVISION
) -> list[str]:
    """Restart every worker that does not answer a ping; returns their old addresses."""
    hung = unresponsive_workers(client, timings)
    if hung:
        log.warning("restarting unresponsive workers %s", hung)
        restart_s = min(timeout_s, timings.restart_timeout_s)
        client.restart_workers(hung, timeout=restart_s, raise_for_error=False)
    return hung


def unresponsive_workers(
    client: distributed.Client, timings: SupervisionConfig = DEFAULT_SUPERVISION
) -> list[str]:
    """Workers that do not run a trivial function within timings.ping_timeout_s (stopped,
    wedged)."""
    workers = sorted(cluster_workers(client, timings.scheduler_timeout_s))
    if not workers:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(workers))
    try:
        # os.getpid: a function every worker has imported already. A function of this module
        # would be imported with torch on first use, which takes longer than the timeout on
        # a busy host for the worker a nanny has just started in place of a killed one: it
        # was then "restarted" as hung mid-start, and that restart could leave it gone.
        pings = {w: pool.submit(client.run, os.getpid, workers=[w]) for w in workers}
        concurrent.futures.wait(pings.values(), timeout=timings.ping_timeout_s)
        return [w for w, ping in pings.items() if not ping.done() or ping.exception()]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _next_world_size(
    client: distributed.Client,
    world_size: int | None,
    min_workers: int | None,
    timeout_s: float,
    timings: SupervisionConfig = DEFAULT_SUPERVISION,
) -> int | None:
    """Wait for the full group; settle for `min_workers` when the cluster stays smaller."""
    wanted = world_size or len(cluster_workers(client, timings.scheduler_timeout_s))
    try:
        client.wait_for_workers(wanted, timeout=timeout_s)
        return world_size
    except TimeoutError:
        available = len(cluster_workers(client, timings.scheduler_timeout_s))
        floor = min_workers if min_workers is not None else wanted
        if available >= max(1, floor):
            log.warning("continuing with %d ranks instead of %d", available, wanted)
            return available
        allowed = (
            f"min_workers={min_workers} allows no fewer"
            if min_workers is not None
            else "pass --min-workers to continue with fewer ranks"
        )
        raise WorkersNotBack(
            f"the DDP group needs {max(1, floor)} workers to relaunch, but only {available} of "
            f"{wanted} were back within {timeout_s:g}s (DDPFLOW_HEAL_TIMEOUT_S); {allowed}, or "
            "find out why the workers did not come back"
        ) from None


def check_settle(settle_s: object) -> None:
    """ValueError naming a settle time that is not a number of seconds >= 0."""
    if isinstance(settle_s, bool) or not isinstance(settle_s, int | float) or settle_s < 0:
        raise ValueError(f"settle_s={settle_s!r} must be a number of seconds >= 0")


def _elastic_size(
    client: distributed.Client,
    previous: int | None,
    floor: int | None,
    max_workers: int,
    rejoin_s: float,
    timeout_s: float,
    timings: SupervisionConfig = DEFAULT_SUPERVISION,
) -> int:
    """An elastic group's next size: the workers there are, up to `max_workers`. A lost
    worker that comes back within `rejoin_s` (a nanny's replacement) is waited for; one
    that does not is left to the grow watch, which takes it when it joins later."""
    if previous:
        with contextlib.suppress(TimeoutError):
            client.wait_for_workers(min(previous, max_workers), timeout=min(rejoin_s, timeout_s))
    needed = max(1, floor or 1)
    try:
        client.wait_for_workers(needed, timeout=timeout_s)
    except TimeoutError:
        available = len(cluster_workers(client, timings.scheduler_timeout_s))
        raise WorkersNotBack(
            f"the DDP group needs {needed} workers (min_workers) to start, but only "
            f"{available} were there within {timeout_s:g}s (DDPFLOW_HEAL_TIMEOUT_S); lower "
            "min_workers, or find out why the workers did not come"
        ) from None
    return min(max_workers, len(cluster_workers(client, timings.scheduler_timeout_s)))
