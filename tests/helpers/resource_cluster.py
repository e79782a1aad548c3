"""A local cluster whose workers declare different Dask resources, as GPU clusters do.

Each worker is a real Nanny + worker process started with its own `resources=` (what
`dask worker --resources GPU=1` sets) and environment (e.g. CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import dask
import distributed
from distributed import Nanny, Scheduler, SpecCluster

from ddpflow.cluster.workers import WORKER_CONFIG


@contextmanager
def resource_cluster(
    workers: Mapping[str, Mapping[str, Any]],
) -> Iterator[tuple[SpecCluster, distributed.Client, dict[str, str]]]:
    """`workers`: name -> {"resources": {...}, "env": {...}}; yields the cluster, a client
    and name -> worker address."""
    dask.config.set(WORKER_CONFIG)
    specs = {
        name: {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "host": "127.0.0.1",
                "resources": dict(spec.get("resources") or {}),
                "env": dict(spec.get("env") or {}),
            },
        }
        for name, spec in workers.items()
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "dashboard_address": ":0"},
    }
    with (
        SpecCluster(workers=specs, scheduler=scheduler, silence_logs=40) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        client.wait_for_workers(len(specs), timeout=120)
        info = client.scheduler_info()["workers"]
        addresses = {w["name"]: addr for addr, w in info.items()}
        yield cluster, client, addresses
