"""Asking a cluster ddpflow started for more workers, so that a training with max_workers
grows as capacity arrives (ddpflow.distributed.supervisor.growth takes them once they stay).

A cluster someone else runs (an address) is left alone: the training only uses the workers
that join it.
"""

from __future__ import annotations

import logging

from distributed.deploy import Cluster

log = logging.getLogger(__name__)


def ask_for_workers(cluster: Cluster, n_workers: int) -> str:
    """Ask `cluster` for `n_workers` workers in all; returns what was asked, for the log.

    A batch-queue cluster (dask-jobqueue) is held at that size by Adaptive, which also
    submits a new job for one that ends (a plain `scale` would not); the others (local,
    cuda, Kubernetes) take `scale`, and their workers come as the machine or the cluster's
    autoscaler allows.
    """
    if type(cluster).__module__.startswith("dask_jobqueue"):
        cluster.adapt(minimum=n_workers, maximum=n_workers)
        return f"kept {n_workers} batch jobs queued or running (adapt)"
    cluster.scale(n_workers)
    return f"scaled the cluster to {n_workers} workers"
