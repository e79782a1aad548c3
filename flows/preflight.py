"""The pre-flight every flow runs first: store, tracking, cluster. Seconds, and nothing written."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import distributed

from ddpflow.config import ARTIFACT_ROOT_ENV, DASK_ADDRESS_ENV, TRACKING_URI_ENV, Settings
from ddpflow.distributed import RankAssignment, cluster_workers, plan_ranks
from ddpflow.distributed.planning import workers_with_resources
from ddpflow.integrations.prefect.flow_client import current_dask_client
from ddpflow.integrations.prefect.task_runner import configured_api_url, prefect_api_url
from ddpflow.preflight.checks import (
    API_PROBE_TIMEOUT_S,
    PreflightError,
    check_artifact_store,
    check_tracking,
    check_workers_reach,
    check_workers_reach_api,
    probe_http_off_loop,
)
from ddpflow.preflight.folder_probe import probe_folder_off_loop
from ddpflow.preflight.import_probe import import_failures
from ddpflow.preflight.plain_scheduler import warn_if_plain_tcp
from ddpflow.storage.redact import clean_cause, redact_url

# Slack on top of the probe's own timeout for the scheduler's round trip to every worker.
PROBE_SLACK_S = 10.0


def run_preflight(settings: Settings, world_size: int | None) -> list[RankAssignment]:
    """Check the artifact store, MLflow and the Dask cluster; return the rank plan."""
    check_artifact_store(settings.artifact_root)
    check_tracking(settings.tracking_uri)
    workers: Mapping[str, Mapping[str, Any]]
    try:
        client = current_dask_client()
        workers = cluster_workers(client)
    except OSError as error:  # distributed raises OSError/TimeoutError when it cannot connect
        raise PreflightError(
            f"Dask scheduler {settings.dask_address} is not reachable ({error}). Start it or "
            f"fix {DASK_ADDRESS_ENV}."
        ) from error
    # A connected client has its scheduler's handle, and the handle its address.
    assert client.scheduler is not None and client.scheduler.address is not None
    warn_if_plain_tcp(client.scheduler.address)
    # The LocalCluster a flow starts runs on this host with the API URL in its environment;
    # any other cluster's workers may sit where the API cannot be reached.
    if settings.cluster_kind != "local":
        check_cluster_imports_project(client)
        check_workers_reach_flow_api(client)
        check_workers_reach_stores(client, settings)
    if settings.rank_resources:  # ranks only on workers that declare them, e.g. GPU=1
        workers = workers_with_resources(workers, settings.rank_resources, world_size)
    return plan_ranks(workers, world_size)


def rank_workers(world_size: int | None = None) -> list[str]:
    """The cluster's workers that may run a rank, sorted: all of them, or only those that
    declare DDPFLOW_RANK_RESOURCES (PlanError when fewer than `world_size` do)."""
    workers: Mapping[str, Mapping[str, Any]] = cluster_workers(current_dask_client())
    resources = Settings.from_env().rank_resources
    if resources:  # e.g. {"GPU": 1}: ranks run on GPU workers only
        workers = workers_with_resources(workers, resources, world_size)
    return sorted(workers)


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

    embedded = api_url is None and not configured_api_url()
    check_workers_reach_api(url, probe_workers, timeout_s, embedded=embedded)


SHARED_FOLDER_FIX = "mount one shared folder at the same path on every host, or use s3://"
IMPORT_FIX = (
    "Start the scheduler and every worker with this checkout (the folder holding flows/ and "
    "tasks/, the same commit) on their PYTHONPATH, as docs/multi-host.md shows"
)


def check_cluster_imports_project(
    client: distributed.Client, timeout_s: float = API_PROBE_TIMEOUT_S
) -> None:
    """The scheduler and every worker import the checkout's `flows` and `tasks` (the task
    graph refers to them), or the flow stops here, before any task, naming the fix."""

    try:
        answers: dict[str, object] = dict(
            client.run(import_failures, on_error="return", callback_timeout=timeout_s)
        )
    except Exception as error:  # noqa: BLE001 - a probe that cannot run is a failed check
        raise PreflightError(
            f"could not ask the Dask workers whether they import this checkout's code "
            f"({type(error).__name__}: {error}). {IMPORT_FIX}."
        ) from clean_cause(error)
    try:
        answers["the scheduler"] = client.run_on_scheduler(import_failures)
    except Exception as error:  # noqa: BLE001 - a scheduler without ddpflow says so here
        answers["the scheduler"] = f"{type(error).__name__}: {error}"
    failed = {name: str(answer) for name, answer in answers.items() if answer is not None}
    if failed:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in sorted(failed.items()))
        raise PreflightError(
            f"{len(failed)} of {len(answers)} Dask processes (scheduler and workers) cannot "
            f"import this checkout's code, which the flow's tasks refer to ({reasons}). "
            f"{IMPORT_FIX}."
        )


def check_workers_reach_stores(
    client: distributed.Client, settings: Settings, timeout_s: float = API_PROBE_TIMEOUT_S
) -> None:
    """Workers on other hosts write to the artifact store and rank 0 logs to MLflow: a local
    folder or SQLite file must be the same shared folder there, a server reachable."""

    def on_workers(probe: Callable[..., Any], target: str) -> Callable[[], Any]:
        return lambda: client.run(
            probe, target, on_error="return", callback_timeout=timeout_s + PROBE_SLACK_S
        )

    tracking = settings.tracking_uri
    if tracking.startswith(("http://", "https://")):
        health = f"{tracking.rstrip('/')}/health"
        check_workers_reach(
            f"MLflow tracking server {redact_url(tracking)}",
            f"where rank 0 logs metrics and checkpoints; GET {redact_url(health)} failed",
            on_workers(probe_http_off_loop, health),
            f"Run the server on an address the workers reach and set {TRACKING_URI_ENV} to it.",
        )
    elif tracking.startswith("sqlite:///"):
        folder = str(Path(tracking.removeprefix("sqlite:///")).parent)
        check_workers_reach(
            f"the MLflow SQLite store's folder {folder}",
            "where rank 0 logs metrics and checkpoints",
            on_workers(probe_folder_off_loop, folder),
            f"Set {TRACKING_URI_ENV} to an MLflow server the workers reach, or mount one "
            "shared folder at the same path on every host.",
        )
    if "://" not in settings.artifact_root:
        check_workers_reach(
            f"the artifact store {settings.artifact_root}",
            "where every rank reads data and rank 0 writes checkpoints",
            on_workers(probe_folder_off_loop, settings.artifact_root),
            f"Set {ARTIFACT_ROOT_ENV} to a folder every host sees: {SHARED_FOLDER_FIX}.",
        )
