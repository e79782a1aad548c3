"""ddpflow.run() as a Prefect task, for a user's own flow: `ddpflow.run_in_flow(train, ...)`.

It does what the built-in flows' `train-ddp` tasks do around a training: takes the flow's
Dask client (the flow must run on a prefect_dask DaskTaskRunner, e.g. the one
ddpflow.integrations.prefect.task_runner.dask_task_runner builds), sends each ctx.report()
line to the task's Prefect log, logs each restart as a warning, and shows the steps of a
training on ddpflow.fit as the task's progress artifact. The lines and the steps are one
stream of progress events (ddpflow.distributed.progress) that both follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext

from ddpflow.api import refuse_removed_options, run
from ddpflow.distributed.progress import Progress
from ddpflow.distributed.supervisor.relaunch import Restart
from ddpflow.integrations.prefect.flow_client import current_dask_client
from ddpflow.integrations.prefect.progress_artifact import progress_artifact

R = TypeVar("R")
PROGRESS_KEY = "ddp-train-progress"


# NO_CACHE: the inputs are a function and its arguments, which Prefect cannot hash
# reliably, and a training must run each time its flow does.
@task(name="ddp-train", cache_policy=NO_CACHE)
def ddp_train(train: Callable[..., R], args: tuple, options: dict[str, Any]) -> R:
    """Rank 0's result of ddpflow.run(client, train, *args, **options) on the flow's cluster."""
    logger = get_run_logger()  # fetched here: the callbacks run on the Dask client's thread
    client = current_dask_client()
    on_progress = options.pop("on_progress", None)
    on_restart = options.pop("on_restart", None)
    on_event = options.pop("on_event", None)

    def progress(line: str) -> None:
        logger.info(line)
        if on_progress is not None:
            on_progress(line)

    def restarted(restart: Restart) -> None:
        logger.warning(
            "DDP group restart %d (world size %s): %s",
            restart.attempt,
            restart.world_size or "all",
            restart.cause,
        )
        if on_restart is not None:
            on_restart(restart)

    # The step counts of a training on ddpflow.fit: the task's progress artifact.
    with progress_artifact(PROGRESS_KEY, "DDP training") as artifact:

        def event(progress: Progress) -> None:
            artifact.update(progress)
            if on_event is not None:
                on_event(progress)

        return run(
            client,
            train,
            *args,
            on_progress=progress,
            on_restart=restarted,
            on_event=event,
            **options,
        )


def run_in_flow(train: Callable[..., R], *args: Any, **options: Any) -> R:
    """Inside a flow on a DaskTaskRunner: the `ddp-train` task, called directly (not
    submitted) so ddpflow.run() waits in the flow process and every Dask worker is left to
    a rank. `options` are ddpflow.run()'s keyword arguments."""
    refuse_removed_options("run_in_flow", options)
    if "client" in options:
        raise TypeError("run_in_flow() uses the flow's Dask client: do not pass client=")
    # Checked here, not by the task: a task called outside a flow runs on its own, and
    # would start a Prefect API server before failing for want of a Dask cluster.
    if FlowRunContext.get() is None:
        raise RuntimeError(
            "run_in_flow() must be called inside a Prefect flow (on a DaskTaskRunner); "
            "outside one, call ddpflow.run(client, train, ...) with a Dask client"
        )
    return ddp_train(train, args, dict(options))
