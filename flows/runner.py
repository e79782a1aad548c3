"""The DaskTaskRunner every flow uses, built from the environment (DESIGN's contract)."""

from __future__ import annotations

import distributed
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL
from prefect_dask import DaskTaskRunner

from ddpflow.cluster import local_cluster
from ddpflow.config import Settings


def prefect_api_url() -> str | None:
    """The API the flow talks to, including Prefect's ephemeral one when no server is set.

    Handing it to the workers matters: a worker process without PREFECT_API_URL starts its
    own temporary API server (5-6 s each) the first time it runs a task.
    """
    url = PREFECT_API_URL.value()
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    return server.api_url if server.running else None


def _local_cluster_for_flow(num_workers: int) -> distributed.LocalCluster:
    url = prefect_api_url()
    return local_cluster(num_workers, env={"PREFECT_API_URL": url} if url else None)


def dask_task_runner(settings: Settings | None = None) -> DaskTaskRunner:
    """An existing scheduler when DDPFLOW_DASK_ADDRESS is set, else a LocalCluster per flow run."""
    settings = settings or Settings.from_env()
    if settings.dask_address:
        # A dead scheduler should fail pre-flight in seconds, not after the 30 s default.
        return DaskTaskRunner(address=settings.dask_address, client_kwargs={"timeout": "10s"})
    return DaskTaskRunner(
        cluster_class=_local_cluster_for_flow,
        cluster_kwargs={"num_workers": settings.num_dask_workers},
    )


def current_dask_client() -> distributed.Client:
    """The running flow's Dask client; touching it starts the cluster if it is not up yet.

    The DDP launcher uses it from the flow process, so no task holds a worker thread while
    the ranks pinned to the workers wait to start.
    """
    context = FlowRunContext.get()
    if context is None or not isinstance(context.task_runner, DaskTaskRunner):
        raise RuntimeError("current_dask_client() must be called inside a flow on a DaskTaskRunner")
    return context.task_runner.client
