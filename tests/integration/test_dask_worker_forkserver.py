"""`dask worker` processes started with ddpflow's flags (WORKER_CLI_ARGS: the stack, the image,
job scripts, pods, other hosts) fork their workers from a server that imported torch and
MLflow once, as ddpflow's own LocalCluster does, and so does the nanny's restart of a killed
worker. Real processes: the stack's `dask scheduler` and `dask worker --nworkers 2` on
127.0.0.1 (infra.dask_service)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import distributed
import pytest

from ddpflow.cluster.forkserver import FORKSERVER_PRELOAD
from infra.dask_service import start_dask
from infra.procs import stop
from infra.services import free_port
from tests.helpers.paths import CHECKOUT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[distributed.Client]:
    logs = tmp_path_factory.mktemp("dask-worker-forkserver")
    scheduler, workers = start_dask(free_port(), 2, {"PYTHONPATH": str(CHECKOUT)}, logs)
    try:
        with distributed.Client(scheduler.url, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            yield client
    finally:
        stop(workers)
        stop(scheduler)


def _origins(client: distributed.Client) -> dict[str, tuple[str, list[str], int]]:
    """Each worker's parent command line, which preloaded modules it has, and its pid."""

    def ask(names: list[str]) -> tuple[str, list[str], int]:  # nested: shipped by value
        import os
        import sys
        from pathlib import Path

        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ")
        return parent.decode(), [m for m in names if m in sys.modules], os.getpid()

    return client.run(ask, FORKSERVER_PRELOAD)


def test_dask_worker_processes_fork_their_workers_from_a_preloaded_server(client) -> None:
    origins = _origins(client)
    assert len(origins) == 2
    for parent, loaded, _ in origins.values():
        assert "multiprocessing.forkserver" in parent, parent
        assert loaded == FORKSERVER_PRELOAD, loaded


def test_a_killed_worker_comes_back_forked_from_the_same_server(client) -> None:
    """The nanny restarts a SIGKILLed worker from the same preloaded server."""
    before = _origins(client)
    parent, _, pid = next(iter(before.values()))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    after: dict[str, tuple[str, list[str], int]] = {}
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            after = _origins(client)
        except (OSError, distributed.comm.CommClosedError):
            continue
        if len(after) == 2 and pid not in {p for _, _, p in after.values()}:
            break
    else:
        pytest.fail(f"the killed worker (pid {pid}) was not replaced within 60 s: {after}")
    for new_parent, loaded, _ in after.values():
        assert new_parent == parent, (new_parent, parent)
        assert loaded == FORKSERVER_PRELOAD, loaded
