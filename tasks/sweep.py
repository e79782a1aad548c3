"""Prefect tasks for the sweep: each calls ddpflow and returns small typed results."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from prefect import get_run_logger, task

from ddpflow.api import rank_entry
from ddpflow.distributed import launch
from ddpflow.distributed.progress import line_subscriber
from ddpflow.integrations.prefect.flow_client import current_dask_client
from ddpflow.integrations.prefect.progress_artifact import progress_artifact
from ddpflow.training.result import TrainResult
from ddpflow.workloads.sweep import trial_rank
from ddpflow.workloads.sweep.trial import TrialJob, workload_of

TABLE_KEY = "charlm-sweep"


@task(name="train-trial", task_run_name="train-trial-{index}")
def train_trial(
    index: int,
    job: TrialJob,
    workers: list[str],
    rank_timeout_s: float,
    rank_resources: Mapping[str, float] | None,
) -> TrainResult:
    """One trial's DDP group on its own workers (a pet-name or an image trial: its job says).

    Called directly from a flow thread (not .submit): the launcher must run in the flow
    process, never in a task that holds a worker thread.
    """
    client = current_dask_client()
    key = f"{workload_of(job)}-trial-{index}-progress"
    with progress_artifact(key, f"trial {index}") as artifact:
        results = launch(
            client,
            rank_entry,
            trial_rank,
            (job,),
            job.train_settings(),
            job.run,
            world_size=len(workers),
            workers=workers,
            timeout_s=rank_timeout_s,
            resources=dict(rank_resources) if rank_resources else None,
            # The lines in this trial task's log, the steps in its progress artifact.
            subscribers=(line_subscriber(get_run_logger().info), artifact.update),
        )
    result, unsent = results[0]
    return replace(result, unsent=unsent)
