"""ddpflow's LocalCluster keeps a nanny that is restarting its worker (ddpflow.cluster.
kept_nannies): Dask's own closed it once the worker had been away longer than
`distributed.deploy.lost-worker-timeout`, and the cluster stayed a worker short.

Real processes: a LocalCluster of one worker process whose restarts are made slow by a
worker preload (a start after the first sleeps 6 s before the worker registers, as a worker
importing its libraries on a loaded machine does), with the timeout shortened to 1 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import dask
import distributed
import pytest

from ddpflow.cluster.build import local_cluster
from ddpflow.distributed.supervisor.watch import cluster_workers

pytestmark = pytest.mark.integration

SLOW_RESTART = textwrap.dedent("""
    import os, time
    marker = os.environ["SLOW_RESTART_MARKER"]
    if os.path.exists(marker):
        time.sleep(6)  # a restart: register well after the lost-worker timeout
    else:
        open(marker, "w").close()
""")


@contextlib.contextmanager
def slow_restarting_cluster(tmp_path: Path, n_workers: int) -> Iterator[tuple]:
    """ddpflow's LocalCluster and a client, each restart slow, the lost-worker timeout 1 s."""
    preload = tmp_path / "slow_restart.py"
    preload.write_text(SLOW_RESTART)
    env = {"SLOW_RESTART_MARKER": str(tmp_path / "started-once")}
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "1s"}),
        local_cluster(n_workers, tls=False, preload=[str(preload)], env=env) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(n_workers, timeout=60)
        yield cluster, client


def test_a_worker_whose_restart_outlasts_the_lost_worker_timeout_comes_back(tmp_path):
    with slow_restarting_cluster(tmp_path, 1) as (cluster, client):
        [(address, pid)] = client.run(os.getpid).items()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while address in cluster_workers(client) and time.monotonic() < deadline:
            time.sleep(0.2)  # until the scheduler has let the killed worker go
        client.wait_for_workers(1, timeout=60)
        [new_pid] = client.run(os.getpid).values()
        assert new_pid != pid
        assert len(cluster.workers) == 1, "the nanny that restarted it is still the cluster's"


def test_a_retired_workers_nanny_is_still_forgotten(tmp_path):
    with slow_restarting_cluster(tmp_path, 2) as (cluster, client):
        leaving = sorted(cluster_workers(client))[0]
        client.retire_workers([leaving], close_workers=True)
        deadline = time.monotonic() + 30
        while len(cluster.workers) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(cluster.workers) == 1, "a nanny that closed is forgotten, as Dask does"
        assert len(cluster_workers(client)) == 1
