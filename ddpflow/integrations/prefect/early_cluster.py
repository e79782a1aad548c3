"""Start a flow's own LocalCluster while Prefect's embedded API is still starting.

A first run in a new project waits seconds for the embedded API (its database is created
and migrated), and this process is idle for most of that wait once its imports are done.
The LocalCluster the flow would build next (a forkserver that imports torch, two worker
processes) takes seconds too, so a flow's command line starts it here, in a thread, with
the same settings the flow's task runner would use; `adopt` hands it to the task runner,
which owns and closes it from then on, as one it built itself.

Only the default local cluster is started early (no DDPFLOW_DASK_ADDRESS, no other
DDPFLOW_CLUSTER, no DDPFLOW_CLUSTER_OPTIONS). Whatever would make the flow build another
cluster (other settings by the time it runs), or a start that failed, is dropped here and
the flow builds its own as before, so an error is reported by the flow, not by this module.

The hand-off is the cluster object itself, in this process: its TLS credentials
(DDPFLOW_LOCAL_CLUSTER_TLS, on by default) stay in it, and the runner's client takes them
from it, as from a cluster it built.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import distributed

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 10.0
ADOPTED = "using the LocalCluster started beside the embedded API (ddpflow.integrations.prefect)"

# (number of workers, the API URL its workers were given, TLS on, the cluster being started)
_pending: tuple[int, str, bool, concurrent.futures.Future[distributed.LocalCluster]] | None = None


def start_early(api_url: str) -> None:
    """Start the default LocalCluster in a thread now; no-op for any other cluster."""
    global _pending
    from ddpflow.config import Settings

    try:
        settings = Settings.from_env(os.environ)
    except ValueError:  # ConfigError included
        return  # the flow reports it, naming the setting
    if settings.dask_address or settings.cluster_kind != "local" or settings.cluster_options:
        return
    workers, tls = settings.num_dask_workers, settings.local_cluster_tls
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddpflow-early-cluster")
    future = pool.submit(_start, workers, api_url, tls)
    pool.shutdown(wait=False)
    _pending = (workers, api_url, tls, future)
    atexit.register(_close_unadopted)


def _start(num_workers: int, api_url: str, tls: bool) -> distributed.LocalCluster:
    from ddpflow.cluster.build import local_cluster
    from ddpflow.integrations.prefect.flow_workers import prepare_flow_workers

    prepare_flow_workers()
    return local_cluster(num_workers, env={"PREFECT_API_URL": api_url}, tls=tls)


def adopt(
    num_workers: int, api_url: str | None, options: dict[str, Any], tls: bool = True
) -> distributed.LocalCluster | None:
    """The early cluster if it is the one the flow asks for (same workers, same API, same
    TLS setting, no other options), else None (the flow builds its own; an early one is
    closed)."""
    global _pending
    if _pending is None:
        return None
    workers, early_url, early_tls, future = _pending
    _pending = None
    if (workers, early_url, early_tls, options) != (num_workers, api_url, tls, {}):
        _close(future)
        return None
    try:
        cluster = future.result()
    except Exception as error:  # noqa: BLE001 - the flow's own start reports the cause
        log.info("the early LocalCluster did not start (%s); the flow starts one", error)
        return None
    return cluster


def _close_unadopted() -> None:
    """At exit before `adopt` (a refused parameter, a failed pre-flight): close it."""
    global _pending
    if _pending is not None:
        _close(_pending[3])
        _pending = None


def _close(future: concurrent.futures.Future[distributed.LocalCluster]) -> None:
    try:
        cluster = future.result()
    except Exception:  # noqa: BLE001 - nothing started, nothing to close
        return
    cluster.close(timeout=CLOSE_TIMEOUT_S)
