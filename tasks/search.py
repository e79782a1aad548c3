"""The Prefect task of a searched trial: the trial's DDP group, judged epoch by epoch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ddpflow.api import rank_entry
from ddpflow.distributed import launch
from ddpflow.distributed.progress import Subscriber, line_subscriber
from ddpflow.integrations.prefect.flow_client import current_dask_client
from ddpflow.integrations.prefect.progress_artifact import progress_artifact
from ddpflow.training.result import TrainResult
from ddpflow.workloads.sweep.pruning import Verdicts, search_trial_rank
from ddpflow.workloads.sweep.trial import TrialJob, workload_of


# NO_CACHE: `referee` (a live object with a thread) is no input to hash.
@task(name="train-trial", task_run_name="train-trial-{index}", cache_policy=NO_CACHE)
def train_search_trial(
    index: int,
    job: TrialJob,
    workers: list[str],
    rank_timeout_s: float,
    rank_resources: Mapping[str, float] | None,
    verdicts: Verdicts,
    referee: Subscriber,
) -> TrainResult:
    """One searched trial's DDP group on its own workers; `referee` gets its progress (each
    epoch's validation loss) and answers through `verdicts`. Called directly from a flow
    thread (not .submit), as tasks.sweep.train_trial."""
    client = current_dask_client()
    key = f"{workload_of(job)}-trial-{index}-progress"
    with progress_artifact(key, f"trial {index}") as artifact:
        results = launch(
            client,
            rank_entry,
            search_trial_rank,
            (job, verdicts),
            job.train_settings(),
            job.run,
            world_size=len(workers),
            workers=workers,
            timeout_s=rank_timeout_s,
            resources=dict(rank_resources) if rank_resources else None,
            subscribers=(line_subscriber(get_run_logger().info), artifact.update, referee),
        )
    result, unsent = results[0]
    return replace(result, unsent=unsent)
