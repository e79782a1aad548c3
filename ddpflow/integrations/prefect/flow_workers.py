"""The workers of a flow's own cluster start with Prefect imported, its settings their own.

A worker imports Prefect, prefect-dask and Prefect's task engine when it unpickles its
first Prefect task: 0.55 CPU-seconds on a 2-core machine, at every worker start and every
restart after a lost worker. Forked from a server that imported them once
(ddpflow.cluster.forkserver.preload_also), it has them already. But Prefect reads its
settings into its root context when it is imported (prefect.context), so a forked worker
would keep those of the process that started the cluster, not the ones its nanny hands it
(PREFECT_API_URL among them). Prefect tasks run in their flow's settings context
(prefect-dask ships it with each task), but a rank runs outside any: so this module is
also the workers' Dask preload, which reads the root settings anew from the worker's own
environment (Prefect's `refresh_global_settings_context`) before the worker takes a task.
"""

from __future__ import annotations

import sys

import dask

from ddpflow.cluster.forkserver import preload_also

WORKER_MODULES = ("prefect", "prefect_dask", "prefect.task_engine")
WORKER_PRELOAD_KEY = "distributed.worker.preload"


def prepare_flow_workers() -> None:
    """Preload Prefect in the forkserver of this process's clusters, and read its settings
    anew in each of their workers. For clusters started from now on, in a process whose
    forkserver has not started yet (it starts with the process's first cluster): a flow
    calls this before it builds its cluster."""
    preload_also(WORKER_MODULES)
    preloads = list(dask.config.get(WORKER_PRELOAD_KEY, default=None) or [])
    if __name__ not in preloads:
        dask.config.set({WORKER_PRELOAD_KEY: [*preloads, __name__]})


def dask_setup(worker: object) -> None:
    """Dask's preload hook, in each worker process after its nanny set its environment."""
    if "prefect.context" in sys.modules:  # forked from a server that imported Prefect
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
