"""The pre-flight every flow runs first: store, tracking, cluster. Seconds, and nothing written."""

from __future__ import annotations

from ddpflow.config import DASK_ADDRESS_ENV, Settings
from ddpflow.distributed import RankAssignment, cluster_workers, plan_ranks
from ddpflow.distributed.planning import workers_with_resources
from ddpflow.preflight import PreflightError, check_artifact_store, check_tracking
from flows.runner import current_dask_client


def run_preflight(settings: Settings, world_size: int | None) -> list[RankAssignment]:
    """Check the artifact store, MLflow and the Dask cluster; return the rank plan."""
    check_artifact_store(settings.artifact_root)
    check_tracking(settings.tracking_uri)
    try:
        workers = cluster_workers(current_dask_client())
    except OSError as error:  # distributed raises OSError/TimeoutError when it cannot connect
        raise PreflightError(
            f"Dask scheduler {settings.dask_address} is not reachable ({error}). Start it or "
            f"fix {DASK_ADDRESS_ENV}."
        ) from error
    if settings.rank_resources:  # ranks only on workers that declare them, e.g. GPU=1
        workers = workers_with_resources(workers, settings.rank_resources, world_size)
    return plan_ranks(workers, world_size)
