"""ddpflow.run(): one user training function on a Dask cluster as a DDP group.

The replacement for `dask_pytorch_ddp.dispatch.run(client, train_fn)`: ranks are pinned one
per worker, the process group is set up and torn down for the function, and a group that
fails (a worker killed or hung) is healed and relaunched up to `max_restarts` times. The
function resumes by itself from its latest checkpoint (TrainContext.resume), so a restart
continues exactly where the failed attempt's last checkpoint left it.

Everything here is validated in the caller's process before any rank starts.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, ParamSpec, TypeVar

import cloudpickle
import distributed

from ddpflow.config import DEFAULT_SETTLE_S
from ddpflow.distributed.context import RankContext
from ddpflow.distributed.launcher import cluster_workers
from ddpflow.distributed.progress import Progress, Subscriber, line_subscriber
from ddpflow.distributed.supervisor.relaunch import (
    Resize,
    Restart,
    check_settle,
    check_world_bounds,
    launch_with_restarts,
)
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.loggers import RunRef, close_logger, logger_for_rank, spool_folder
from ddpflow.tracking.run import (
    default_artifact_location,
    end_run,
    failed_on_error,
    log_restart,
    log_world_sizes,
    sqlite_folder,
    start_run,
    world_size_history,
)
from ddpflow.tracking.spool import Unsent
from ddpflow.training.settings import TrainSettings, check_seed

R = TypeVar("R")
P = ParamSpec("P")

# Keyword options the public API documented and later removed, by function: a call that
# still passes one fails with Python's own words for it plus what replaced it and how to
# move, instead of the bare "unexpected keyword argument". CHANGELOG.md lists the same.
REMOVED_OPTIONS: dict[str, dict[str, str]] = {
    "run": {
        "progress_topic": (
            "it was removed in ddpflow 0.2.0. Pass on_event=callback instead: it gets every "
            "ddpflow.Progress event in this process (ddpflow.fit's step counts, epoch and "
            "losses, and the ctx.report() lines), so nothing needs client.subscribe_topic() "
            "(docs/api.md, CHANGELOG.md)"
        ),
    },
}
# run_in_flow()'s options are run()'s keyword arguments.
REMOVED_OPTIONS["run_in_flow"] = REMOVED_OPTIONS["run"]


def refuse_removed_options(function: str, options: Mapping[str, Any]) -> None:
    """Raise TypeError naming the replacement of any removed option of `function` given."""
    removed = REMOVED_OPTIONS.get(function, {})
    for name in options:
        if name in removed:
            raise TypeError(
                f"{function}() got an unexpected keyword argument {name!r}: {removed[name]}"
            )


def refuses_removed_options(function: Callable[P, R]) -> Callable[P, R]:
    """`function`, checking its keyword arguments against REMOVED_OPTIONS first. Its
    signature and type hints stay its own (functools.wraps), free of the removed names."""

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        refuse_removed_options(function.__name__, kwargs)
        return function(*args, **kwargs)

    return checked


@refuses_removed_options
def run(
    client: distributed.Client,
    train: Callable[..., R],
    *args: Any,
    world_size: int | None = None,
    min_workers: int | None = None,
    max_workers: int | None = None,
    settle_s: float = DEFAULT_SETTLE_S,
    max_restarts: int = 2,
    checkpoint_dir: str | None = None,
    keep_last: int = 3,
    seed: int = 0,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    run_name: str = "ddpflow",
    params: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    timeout_s: float = 120.0,
    on_progress: Callable[[str], None] | None = None,
    on_restart: Callable[[Restart], None] | None = None,
    on_event: Callable[[Progress], None] | None = None,
    on_resize: Callable[[Resize], None] | None = None,
) -> R:
    """Run `train(ctx, *args)` on `world_size` Dask workers (default: all); rank 0's result.

    checkpoint_dir: a folder or s3:// URI every rank can read, for ctx.save_checkpoint()
        and ctx.resume(). A folder that already holds checkpoints is resumed from: give
        each training its own.
    tracking_uri + experiment: create an MLflow run (`run_name`, `params`) that rank 0's
        ctx.log_metrics() logs into; it ends FINISHED, or FAILED on error. tracking_uri +
        run_id: log into an existing run and leave its status alone. Neither: no tracking.
    min_workers: the fewest ranks a relaunch after a lost worker goes on with (default: the
        world size; with max_workers, 1).
    max_workers: makes the group elastic both ways: it starts with the workers there are
        (world_size, if given), and workers that join and stay `settle_s` seconds make it
        grow, up to max_workers, at ddpflow.fit's next control step (a step checkpoint, then
        a relaunch that spends no restart). on_resize gets each change (a Resize); the run's
        tags `ddpflow.final_world_size` and `ddpflow.world_sizes` name the size it ended at
        and every size it ran at.
    timeout_s: bounds rank start-up, each collective and the time between two heartbeats.
    on_progress: gets each ctx.report() line; on_restart: each Restart (cause, attempt).
    on_event: gets every progress event (ddpflow.distributed.progress.Progress) of every
        attempt, from the same channel as on_progress's lines: those lines, and
        ddpflow.fit's step counts (every 2 s at most, and at each epoch's end). run_in_flow
        shows them as the task's progress artifact.
    Raises ValueError/TypeError for bad input before any work, and a LaunchError
    (RestartsExhausted, RepeatedFailure, WorkersNotBack) when the group cannot finish.
    """
    check_inputs(client, train, args, world_size, max_restarts, keep_last, timeout_s)
    check_world_bounds(world_size, min_workers, max_workers)
    check_settle(settle_s)
    check_seed(seed)
    check_tracking(tracking_uri, experiment, run_id)
    check_callbacks(
        on_progress=on_progress, on_event=on_event, on_restart=on_restart, on_resize=on_resize
    )
    owned = experiment is not None and run_id is None
    ref: RunRef | None = None
    if owned:
        assert tracking_uri is not None and experiment is not None  # check_tracking, owned
        # A new experiment in a SQLite store keeps MLflow's artifact copies (checkpoints)
        # beside the store's file, not in the caller's working directory (./mlruns).
        location = default_artifact_location(
            tracking_uri, sqlite_folder(tracking_uri) / "mlartifacts"
        )
        ref = start_run(tracking_uri, experiment, run_name, dict(params or {}), {}, location)
    elif run_id is not None:
        assert tracking_uri is not None  # check_tracking: a run_id comes with its store
        ref = RunRef(tracking_uri, run_id)
    run_id = ref.run_id if ref else None
    settings = TrainSettings(checkpoint_dir, keep_last, seed, run_id)

    def restarted(restart: Restart) -> None:
        if ref is not None:
            log_restart(ref, restart.attempt, restart.cause)
        if on_restart is not None:
            on_restart(restart)

    resizes: list[Resize] = []

    def resized(resize: Resize) -> None:
        resizes.append(resize)  # the run's tags name every size once training ends
        if on_resize is not None:
            on_resize(resize)

    with failed_on_error(ref) if owned and ref is not None else nullcontext():
        outcomes, _ = launch_with_restarts(
            client,
            rank_entry,
            train,
            args,
            settings,
            ref,
            world_size=world_size,
            min_workers=min_workers,
            max_workers=max_workers,
            settle_s=settle_s,
            timeout_s=timeout_s,
            max_restarts=max_restarts,
            on_restart=restarted,
            on_resize=resized,
            subscribers=subscribers(on_progress, on_event),
        )
        if ref is not None:
            log_world_sizes(ref, world_size_history(resizes, len(outcomes)))
    result, unsent = outcomes[0]
    if owned and ref is not None:  # owned: ref is the run this call started
        end_run(ref, unsent=unsent)  # a run that lacks logging calls is tagged so
    return result


def subscribers(
    on_progress: Callable[[str], None] | None, on_event: Callable[[Progress], None] | None
) -> list[Subscriber]:
    """The subscribers of the launches' one progress channel: the lines, then the events."""
    found = [line_subscriber(on_progress)] if on_progress is not None else []
    return found + ([on_event] if on_event is not None else [])


def rank_entry(
    rank_ctx: RankContext,
    train: Callable[..., R],
    args: tuple,
    settings: TrainSettings,
    ref: RunRef | None,
) -> tuple[R, tuple[Unsent, ...]]:
    """On each rank's worker: `train(ctx, *args)` with its TrainContext (a user's function,
    or a built-in workload's `train_rank`). Then the logger's calls are sent (bounded, the
    heartbeat kept going); what MLflow still lacks comes back with the result, so the run
    can say it is incomplete. Rank 0's calls wait on disk during an MLflow outage, where
    `settings.spool_beside` says (the workloads: beside their run's checkpoints)."""
    logger = None
    if ref is not None:
        beside = settings.spool_beside
        spool = spool_folder(beside, ref.run_id) if beside else None
        logger = logger_for_rank(rank_ctx.is_main, ref, spool)
    unsent: list[Unsent] = []
    # Imported on the rank: the launching process (a flow's) starts without torch.
    from ddpflow.training.context import TrainContext

    try:
        result = train(TrainContext(rank_ctx, settings, logger), *args)
    finally:
        if logger is not None:
            unsent = close_logger(logger, rank_ctx.heartbeat)
    return result, tuple(unsent)


def check_inputs(
    client: Any,
    train: Any,
    args: tuple,
    world_size: Any,
    max_restarts: Any,
    keep_last: Any,
    timeout_s: Any,
) -> None:
    """Fail before any work, naming the input and the fix."""
    if not isinstance(client, distributed.Client):
        raise TypeError(
            f"client must be a distributed.Client, got {type(client).__name__}: "
            "connect one with distributed.Client(cluster_or_address)"
        )
    check_train(train, args)
    for name, value, low in (("max_restarts", max_restarts, 0), ("keep_last", keep_last, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds > 0")
    if world_size is None:
        if not cluster_workers(client):
            raise ValueError("the Dask cluster has no workers: start some, or wait for them")
        return
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1 (or None: all workers)")
    workers = len(cluster_workers(client))
    if world_size > workers:
        raise ValueError(
            f"world_size={world_size} is larger than the Dask cluster ({workers} workers): "
            f"pass world_size={workers} or less, or add workers"
        )


def check_train(train: Any, args: tuple) -> None:
    """`train` must be callable as train(ctx, *args) and travel to the workers."""
    if not callable(train):
        raise TypeError(
            f"train must be a function called as train(ctx, *args), got {type(train).__name__}"
        )
    try:
        signature = inspect.signature(train)
    except (TypeError, ValueError):
        signature = None  # some builtins have none; the call itself will tell
    if signature is not None:
        try:
            signature.bind(None, *args)
        except TypeError as error:
            name = getattr(train, "__name__", repr(train))
            raise TypeError(
                f"train={name} cannot be called as train(ctx, *args) with the {len(args)} "
                f"argument(s) given: {error}"
            ) from None
    try:
        cloudpickle.dumps((train, args))
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise TypeError(
            f"train or its args cannot be sent to the Dask workers ({error}): define train "
            "at module level and pass picklable arguments (no open files, locks or clients)"
        ) from None


def check_callbacks(**callbacks: Any) -> None:
    for name, value in callbacks.items():
        if value is not None and not callable(value):
            raise TypeError(
                f"{name} must be a function (or None), got {type(value).__name__}: pass e.g. "
                f"{name}=print"
            )


def check_tracking(tracking_uri: str | None, experiment: str | None, run_id: str | None) -> None:
    if experiment is not None and run_id is not None:
        raise ValueError(
            "pass experiment= (a new MLflow run) or run_id= (an existing one), not both"
        )
    if (experiment is not None or run_id is not None) and not tracking_uri:
        raise ValueError(
            "experiment= and run_id= need tracking_uri= (e.g. sqlite:///mlflow.db or "
            "http://mlflow:5000)"
        )
    if tracking_uri and experiment is None and run_id is None:
        raise ValueError(
            f"tracking_uri={redact_url(tracking_uri)} is given but neither experiment= (a new "
            "run) nor run_id= (an existing one): pass one, or drop tracking_uri"
        )
