"""The pre-flight every flow runs first: store, tracking, cluster. Seconds, and nothing written."""

from __future__ import annotations

from collections.abc import Mapping

import distributed
from prefect.settings import PREFECT_API_URL

from ddpflow.config import DASK_ADDRESS_ENV, Settings
from ddpflow.distributed import RankAssignment, cluster_workers, plan_ranks
from ddpflow.distributed.planning import workers_with_resources
from ddpflow.preflight import (
    API_PROBE_TIMEOUT_S,
    PreflightError,
    check_artifact_store,
    check_tracking,
    check_workers_reach_api,
    probe_http_off_loop,
)
from flows.runner import current_dask_client, prefect_api_url

# Slack on top of the probe's own timeout for the scheduler's round trip to every worker.
PROBE_SLACK_S = 10.0


def run_preflight(settings: Settings, world_size: int | None) -> list[RankAssignment]:
    """Check the artifact store, MLflow and the Dask cluster; return the rank plan."""
    check_artifact_store(settings.artifact_root)
    check_tracking(settings.tracking_uri)
    try:
        client = current_dask_client()
        workers = cluster_workers(client)
    except OSError as error:  # distributed raises OSError/TimeoutError when it cannot connect
        raise PreflightError(
            f"Dask scheduler {settings.dask_address} is not reachable ({error}). Start it or "
            f"fix {DASK_ADDRESS_ENV}."
        ) from error
    # The LocalCluster a flow starts runs on this host with the API URL in its environment;
    # any other cluster's workers may sit where the API cannot be reached.
    if settings.cluster_kind != "local":
        check_workers_reach_flow_api(client)
    if settings.rank_resources:  # ranks only on workers that declare them, e.g. GPU=1
        workers = workers_with_resources(workers, settings.rank_resources, world_size)
    return plan_ranks(workers, world_size)


def check_workers_reach_flow_api(
    client: distributed.Client, api_url: str | None = None, timeout_s: float = API_PROBE_TIMEOUT_S
) -> None:
    """Ask every worker, bounded in time, whether it reaches the flow's Prefect API."""
    url = api_url or prefect_api_url()
    if not url:
        return

    def probe_workers(health_url: str, probe_timeout_s: float) -> Mapping[str, object]:
        return client.run(
            probe_http_off_loop,
            health_url,
            timeout=probe_timeout_s,
            on_error="return",
            callback_timeout=probe_timeout_s + PROBE_SLACK_S,
        )

    embedded = api_url is None and not PREFECT_API_URL.value()
    check_workers_reach_api(url, probe_workers, timeout_s, embedded=embedded)
