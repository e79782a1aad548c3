"""The pre-flight every flow runs first: store, tracking, cluster. Seconds, and nothing written."""

from __future__ import annotations

from ddpflow.config import DASK_ADDRESS_ENV, Settings
from ddpflow.distributed import RankAssignment, plan_ranks
from ddpflow.preflight import PreflightError, check_artifact_store, check_tracking
from flows.runner import current_dask_client


def run_preflight(settings: Settings, world_size: int | None) -> list[RankAssignment]:
    """Check the artifact store, MLflow and the Dask cluster; return the rank plan."""
    check_artifact_store(settings.artifact_root)
    check_tracking(settings.tracking_uri)
    try:
        workers = current_dask_client().scheduler_info()["workers"]
    except OSError as error:  # distributed raises OSError/TimeoutError when it cannot connect
        raise PreflightError(
            f"Dask scheduler {settings.dask_address} is not reachable ({error}). Start it or "
            f"fix {DASK_ADDRESS_ENV}."
        ) from error
    return plan_ranks(workers, world_size)
