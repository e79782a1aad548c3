"""The settings a real worker process of ddpflow's LocalCluster runs with.

ddpflow.cluster.build sets them in the flow's process; a worker process gets them only if the nanny
hands them over, so this asks one real worker (one LocalCluster worker, a few seconds).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import dask
import distributed
import pytest

from ddpflow.cluster.build import local_cluster
from tests.helpers.flow_worker_probe import NANNY_URL
from tests.helpers.json_script import json_answer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker_client() -> Iterator[distributed.Client]:
    saved = copy.deepcopy(dask.config.config)  # local_cluster sets ddpflow's config globally
    try:
        with local_cluster(1) as cluster, distributed.Client(cluster) as client:
            client.wait_for_workers(1, timeout=60)
            yield client
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)


def _settings(client: distributed.Client, nanny: bool = False) -> dict[str, Any]:
    """Dask's config and the periodic jobs of the one worker (or its nanny), asked in it."""

    def ask(dask_worker: Any) -> dict[str, Any]:  # nested: cloudpickle ships it by value
        import os

        import dask

        return {
            "profile": dask.config.get("distributed.worker.profile.enabled"),
            "callbacks_ms": {k: c.callback_time for k, c in dask_worker.periodic_callbacks.items()},
            "malloc": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            "daemon": dask.config.get("distributed.worker.daemon"),
        }

    (answer,) = client.run(ask, nanny=nanny).values()
    return answer


def test_a_worker_runs_without_the_profiler_and_with_slow_monitors(worker_client) -> None:
    # bench/worker_overhead.py measured what each of these costs a rank (docs/benchmarks.md).
    got = _settings(worker_client)
    callbacks = got["callbacks_ms"]
    assert got["profile"] is False
    assert "profile" not in callbacks and "profile-cycle" not in callbacks
    assert callbacks["tick"] == 1000  # Dask's default: every 20 ms
    assert callbacks["monitor"] == 2000  # every 500 ms
    assert callbacks["memory_monitor"] == 1000  # every 100 ms
    assert "heartbeat" in callbacks and "keep-alive" in callbacks  # what keeps it registered
    assert got["malloc"] is None and got["daemon"] is False


def test_the_nanny_runs_with_the_same_slow_monitors(worker_client) -> None:
    got = _settings(worker_client, nanny=True)
    callbacks = got["callbacks_ms"]
    assert callbacks["tick"] == 1000
    assert callbacks["memory_monitor"] == 1000  # the nanny's: terminate above 95 %


def _probe(*args: str) -> dict[str, Any]:
    return json_answer("tests.helpers.flow_worker_probe", *args, timeout_s=300)


# ddpflow/integrations/prefect/flow_workers.py: a flow's workers fork with Prefect imported
# (0.55 CPU-seconds less at each worker start), and read its settings from their own
# environment, not from the process that started the forkserver.
def test_a_flows_worker_starts_with_prefect_and_the_api_its_nanny_gave_it() -> None:
    assert _probe() == {"prefect_before_any_task": True, "api_url": NANNY_URL}
    # Without the flows' preparation (a library user's cluster): imported only when used.
    assert _probe("--not-prepared") == {"prefect_before_any_task": False, "api_url": NANNY_URL}
