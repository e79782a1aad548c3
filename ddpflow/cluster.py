"""Build or connect to the Dask cluster the flows run on."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import dask
import distributed

# Set before workers start (the nanny hands its config to the worker process):
# - daemon=False lets a rank start DataLoader processes (daemonic processes cannot fork);
# - the sampling profiler costs ~8 % of a rank's throughput on 2 cores and nobody reads it.
WORKER_CONFIG = {
    "distributed.worker.daemon": False,
    "distributed.worker.profile.enabled": False,
}


def local_cluster(
    num_workers: int = 2,
    env: Mapping[str, str] | None = None,
    local_directory: str | None = None,
    quiet: bool = True,
) -> distributed.LocalCluster:
    """Worker processes with one thread each (one rank per worker), bound to 127.0.0.1."""
    dask.config.set(WORKER_CONFIG)
    if quiet:
        # Dask's INFO lines (every nanny and client start/stop) drown the flow's own output;
        # warnings and errors still show. (Worker processes reset their own logging.)
        logging.getLogger("distributed").setLevel(logging.WARNING)
    return distributed.LocalCluster(
        n_workers=num_workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=":0",  # a free port: concurrent runs must not clash on 8787
        local_directory=local_directory,
        env=dict(env or {}),
    )
