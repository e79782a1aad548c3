"""The running flow's Dask client, for tasks that work from the flow process."""

from __future__ import annotations

import distributed
from distributed.deploy import Cluster
from prefect.context import FlowRunContext
from prefect_dask import DaskTaskRunner


def current_dask_client() -> distributed.Client:
    """The running flow's Dask client; touching it starts the cluster if it is not up yet.

    The DDP launcher uses it from the flow process, so no task holds a worker thread while
    the ranks pinned to the workers wait to start.
    """
    context = FlowRunContext.get()
    if context is None or not isinstance(context.task_runner, DaskTaskRunner):
        raise RuntimeError("current_dask_client() must be called inside a flow on a DaskTaskRunner")
    return context.task_runner.client


def flow_started_cluster() -> Cluster | None:
    """The cluster the running flow's task runner started (local, cuda, jobqueue,
    kubernetes), or None when it connected to one by address (someone else's to size)."""
    context = FlowRunContext.get()
    runner = context.task_runner if context is not None else None
    if not isinstance(runner, DaskTaskRunner) or runner.address is not None:
        return None
    return runner._cluster  # prefect-dask keeps no public handle on the cluster it started
