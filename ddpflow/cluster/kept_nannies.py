"""A LocalCluster that keeps a nanny while it restarts its worker.

Dask's SpecCluster (LocalCluster's base) gives up on a worker the scheduler lost when no
worker of the same name is back within `distributed.deploy.lost-worker-timeout` (15 s): it
closes that worker's nanny and forgets it. That suits a cluster whose workers are jobs (an
Adaptive cluster then submits a new one), but a LocalCluster starts nothing in its place. A
nanny restarts its own worker when the process dies, and on a loaded machine that restart can
take more than 15 s (the new process registers after its imports): the cluster then closed
the very nanny that was bringing the worker back, and stayed a worker short for the rest of
its life. A training waiting for its group to heal then failed with "workers not back".

Here a lost worker's nanny that is still running (restarting its worker) is kept; a nanny
that closed (a worker retired or asked to leave takes its nanny with it) is forgotten after
the same timeout, as Dask does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import dask
import distributed
from dask.utils import parse_timedelta
from distributed.core import Status
from distributed.deploy import Cluster


class KeptNanniesCluster(distributed.LocalCluster):
    """LocalCluster whose lost workers' running nannies are left to restart them."""

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op != "remove":
            super()._update_worker_status(op, msg)
            return
        name = self.scheduler_info["workers"][msg]["name"]

        def forget_if_closed() -> None:
            nanny = self.workers.get(name)
            back = any(w["name"] == name for w in self.scheduler_info["workers"].values())
            if nanny is None or back or getattr(nanny, "status", None) == Status.running:
                return
            self._futures.add(asyncio.ensure_future(nanny.close()))
            del self.workers[name]

        delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
        asyncio.get_running_loop().call_later(delay, forget_if_closed)
        # SpecCluster's own handler is skipped (it would close the nanny); the base class
        # keeps scheduler_info up to date.
        Cluster._update_worker_status(self, op, msg)
