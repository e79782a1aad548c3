"""One DDP training with healing restarts: the `train-ddp` task every workload runs."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event

from ddpflow.api import rank_entry
from ddpflow.cluster.growing import ask_for_workers
from ddpflow.config import LaunchSettings
from ddpflow.distributed.progress import line_subscriber
from ddpflow.distributed.supervisor.relaunch import Resize, Restart, launch_with_restarts
from ddpflow.integrations.prefect.flow_client import current_dask_client, flow_started_cluster
from ddpflow.integrations.prefect.progress_artifact import ProgressArtifact, progress_artifact
from ddpflow.storage.redact import redact_text
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import (
    log_restart,
    log_world_sizes,
    world_size_history,
    world_sizes_text,
)
from ddpflow.training.result import TrainResult
from tasks.tracking_report import publish_unsent

if TYPE_CHECKING:
    from ddpflow.training.context import TrainContext


@dataclass(frozen=True)
class RankFunction:
    """A workload's rank function named "module:function" and imported on the rank.

    The launcher runs in the flow process, which starts without torch (seconds of every run's
    start); the rank functions' modules import it. Named, the function crosses to the
    workers as two strings and is imported there, where torch is loaded already.
    """

    path: str

    def __call__(self, ctx: TrainContext, job: Any) -> TrainResult:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)(ctx, job)


@dataclass(frozen=True)
class DDPWorkload:
    """What sets one workload's training apart: its rank function and its Prefect artifacts."""

    rank_fn: RankFunction
    restarts_key: str  # the restarts table
    progress_key: str  # the progress over all attempts
    incomplete_key: str  # the logging calls the MLflow run lacks


@task(name="train-ddp")
def train_ddp(
    workload: DDPWorkload,
    job: Any,
    world_size: int | None,
    rank_timeout_s: float,
    max_restarts: int = 2,
    min_workers: int | None = None,
    max_workers: int | None = None,
    *,
    launch: LaunchSettings,
) -> TrainResult:
    """Rank 0's result of `workload.rank_fn(ctx, job)`, healed and resumed after failures.

    `rank_fn` is a training function of the public API (ctx: a TrainContext), launched as
    ddpflow.run() launches one; `job.train_settings()` gives its checkpoint folder and seed.

    Call it directly from the flow (not .submit): the launcher then runs in the flow
    process, and no task holds a worker thread while the ranks wait. Each restart is
    counted on the MLflow run, and all of them are listed in the Prefect artifact
    `restarts_key`. Rank 0's progress events reach this task's log (their lines) and the
    progress artifact `progress_key` (their steps), one artifact over all attempts.
    Logging calls rank 0 could not get into MLflow (its `unsent`) are listed in the Prefect
    artifact `incomplete_key`.
    With `max_workers` the group grows onto workers that join
    (ddpflow.distributed.supervisor.growth); each change of its size is a line in this task's
    log, a Prefect event (RESIZED_EVENT) and a note on the progress artifact.
    """
    run: RunRef = job.run
    client = current_dask_client()
    cluster = flow_started_cluster() if max_workers is not None else None
    # A cluster the flow started grows as the training may (looked up with max_workers only).
    if cluster is not None and max_workers is not None:
        asked = ask_for_workers(cluster, max_workers)
        get_run_logger().info("max_workers=%d: %s", max_workers, asked)
    resizes: list[Resize] = []
    with progress_artifact(workload.progress_key, "DDP training") as artifact:
        results, restarts = launch_with_restarts(
            client,
            rank_entry,
            workload.rank_fn,
            (job,),
            job.train_settings(),
            run,
            world_size=world_size,
            min_workers=min_workers,
            max_workers=max_workers,
            settle_s=launch.settle_s,
            timeout_s=rank_timeout_s,
            max_restarts=max_restarts,
            on_restart=lambda restart: log_restart(run, restart.attempt, restart.cause),
            on_resize=lambda resize: announce_resize(run, resize, artifact, resizes),
            heal_timeout_s=launch.heal_timeout_s,
            resources=launch.rank_resources,  # e.g. {"GPU": 1}: GPU workers only
            # Rank 0's per-epoch lines in this task's log, its steps in the artifact.
            subscribers=(line_subscriber(get_run_logger().info), artifact.update),
        )
        # What trained: the ranks that returned are the size it ended at; the resizes, the
        # sizes before (the `world_size` param stays the size it was launched with).
        sizes = world_size_history(resizes, len(results))
        log_world_sizes(run, sizes)
        ended = f"ended at world size {world_sizes_text(sizes)}"
        artifact.note_size(f"{artifact.size_note}; {ended}" if artifact.size_note else ended)
    if restarts:
        create_markdown_artifact(
            markdown=restarts_markdown(run, restarts),
            key=workload.restarts_key,
            description="DDP group restarts",
        )
    result, unsent = results[0]
    if unsent:
        publish_unsent(run, unsent, workload.incomplete_key)
    return replace(result, unsent=unsent, world_sizes=sizes)


RESIZED_EVENT = "ddpflow.training.resized"


def announce_resize(
    run: RunRef, resize: Resize, artifact: ProgressArtifact, resizes: list[Resize]
) -> None:
    """A world-size change in the task's log, as a Prefect event and on the progress
    artifact, kept in `resizes` for the sizes the training ended with. (The MLflow run has
    it as the `world_size` metric, which fit logs, and its tags once training ends.)"""
    resizes.append(resize)
    line = (
        f"world size {resize.old_size} -> {resize.new_size} ({resize.reason}: "
        f"{', '.join(resize.workers) or 'no worker named'})"
    )
    get_run_logger().info(line)
    artifact.note_size(line)
    emit_event(
        event=RESIZED_EVENT,
        resource={"prefect.resource.id": f"ddpflow.mlflow-run.{run.run_id}"},
        payload={
            "old_size": resize.old_size,
            "new_size": resize.new_size,
            "reason": resize.reason,
            "workers": list(resize.workers),
        },
    )


def restarts_markdown(run: RunRef, restarts: list[Restart]) -> str:
    rows = "\n".join(
        f"| {r.attempt} | {r.world_size or 'all'} | {', '.join(r.lost_workers) or '-'} "
        f"| {', '.join(r.new_workers) or '-'} | {', '.join(r.restarted_workers) or '-'} "
        f"| {r.heal_s:.1f} s | {redact_text(r.cause).replace('|', '/')} |"
        for r in restarts
    )
    return (
        f"# DDP restarts of MLflow run `{run.run_id}`\n\n"
        "| restart | world size after | lost workers | new workers | restarted (hung) workers "
        "| heal time | cause |\n"
        f"|---|---|---|---|---|---|---|\n{rows}\n"
    )
