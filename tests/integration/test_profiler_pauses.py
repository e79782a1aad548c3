"""ddpflow.cluster.profiler in a real Dask worker process with two task threads: the profiler
stays stopped while any export in the worker holds it paused, and runs again after the last.
(Why it is paused: ddpflow/cluster/profiler.py; what it prevents:
test_external_cluster.py::test_registrations_on_a_worker_whose_profiler_samples_each_register.)"""

from __future__ import annotations

import dask
import distributed
import pytest

from ddpflow.cluster.build import LOOPBACK_DASHBOARD

pytestmark = pytest.mark.integration


def test_overlapping_pauses_keep_the_profiler_stopped_until_the_last_ends() -> None:
    def first() -> bool:  # pauses first, ends first
        from ddpflow.cluster.profiler import worker_profiler_paused

        with worker_profiler_paused() as paused:
            distributed.Event("first-in").set()
            distributed.Event("second-in").wait(60)
        distributed.Event("first-out").set()
        return paused

    def second() -> tuple[bool, bool]:  # pauses while the first holds, ends last
        from ddpflow.cluster.profiler import worker_profiler_paused

        distributed.Event("first-in").wait(60)
        with worker_profiler_paused() as paused:
            distributed.Event("second-in").set()
            distributed.Event("first-out").wait(60)
            running = distributed.get_worker().periodic_callbacks["profile"].is_running()
        return paused, running

    def profiler_running(dask_worker: distributed.Worker) -> bool:
        return dask_worker.periodic_callbacks["profile"].is_running()

    with (
        dask.config.set({"distributed.worker.profile.enabled": True}),
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=2, processes=True, dashboard_address=LOOPBACK_DASHBOARD
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        assert all(client.run(profiler_running).values())
        ends_first = client.submit(first, pure=False)
        ends_last = client.submit(second, pure=False)
        assert ends_first.result(timeout=120) is True
        assert ends_last.result(timeout=120) == (True, False), "restarted under a pause"
        assert all(client.run(profiler_running).values())
