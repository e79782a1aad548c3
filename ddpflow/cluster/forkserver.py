"""Dask workers forked from one server process that imported their heavy modules once.

A nanny starts its worker with its process's multiprocessing context. Made a forkserver that
preloads FORKSERVER_PRELOAD, every worker (and every restart after a lost worker) forks from
a process that has imported torch, MLflow and the rest, instead of a fresh interpreter that
imports them again. ddpflow's LocalCluster does it in the process that holds its nannies
(ddpflow.cluster.build.local_cluster). A `dask worker` process does it through this module
as its nannies' preload (`--preload-nanny ddpflow.cluster.forkserver`,
ddpflow.cluster.workers.WORKER_CLI_ARGS): Dask imports it in that process and calls
`dask_setup` before the nanny starts its worker.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable
from typing import Any

import dask
import distributed

# Worker processes fork from one server process that has imported these
# once, instead of each starting a fresh interpreter that imports them again: torch alone is
# about 5 s of CPU per worker start (and per restart after a lost worker) on a 2-core
# machine, MLflow (every worker imports it: rank 0 logs to it, evaluation and registration
# use it) 3 s more. None of them starts a thread at import, and importing torch does not
# initialise CUDA, so a forked worker can still use its GPU. None reads a setting ddpflow
# gives workers: MLflow reads only its logging switches (MLFLOW_LOGGING_LEVEL,
# MLFLOW_CONFIGURE_LOGGING) at import, the tracking URI and the rest when used. Prefect is
# not in this list: the library runs without it. It reads its settings (PREFECT_API_URL)
# when imported, and a worker must use the ones its nanny gives it, not the ones of the
# process the server forked from; the flows add it (`preload_also`) with a worker preload
# that reads them anew (ddpflow.integrations.prefect.flow_workers).
# Two more modules every training worker imports the first time it trains: torch._dynamo
# (building any torch optimizer imports it, 1.4 CPU-s) and MLflow's SQL store (rank 0 and
# evaluation logging to a local sqlite: store, 0.75 CPU-s). Neither starts a thread; the
# variables torch._dynamo's config reads at import are the user's own, which the forkserver
# has too. bench/worker_preload.py measures what the pair saves a flow run.
FORKSERVER_PRELOAD = [
    "distributed",
    "numpy",
    "torch",
    "mlflow",
    "torch._dynamo",
    "mlflow.store.tracking.sqlalchemy_store",
]


# What a caller's workers import besides (preload_also), in the order added.
_ALSO_PRELOADED: list[str] = []


def preload_also(modules: Iterable[str]) -> None:
    """Add `modules` to what the forkserver imports, for the workers of this process's
    clusters. A process starts its forkserver with its first cluster and keeps it, with the
    list it started with: so this goes before that one. A module that cannot be imported
    there is skipped (the standard library's forkserver ignores its ImportError)."""
    for module in modules:
        if module not in _ALSO_PRELOADED:
            _ALSO_PRELOADED.append(module)


def fork_workers_from_a_preloaded_server() -> None:
    """Make this process's nannies start their workers from a forkserver that preloads
    FORKSERVER_PRELOAD and what `preload_also` added. Dask sets its own preload list the
    first time it builds the context, so that call comes first and this list replaces it."""
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    distributed.utils.get_mp_context()
    preload = [*FORKSERVER_PRELOAD, *_ALSO_PRELOADED]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)


def dask_setup(nanny: Any) -> None:
    """Dask's preload hook, run in a `dask worker` process before its nanny starts a worker."""
    fork_workers_from_a_preloaded_server()
