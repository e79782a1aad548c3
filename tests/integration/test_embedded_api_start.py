"""The embedded Prefect API a flow's command line starts early
(ddpflow/integrations/prefect/early_api.py): real processes, `python -m flows.train_charlm`
and its uvicorn server, no mocks."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from ddpflow.integrations.prefect.server import server_env, start_server
from tests.integration.charlm_runs import TINY
from tests.integration.conftest import REPO, project_env

pytestmark = pytest.mark.integration


def _server_of(flow: psutil.Process) -> psutil.Process | None:
    for child in flow.children():
        if "prefect.server.api.server:create_app" in " ".join(child.cmdline()):
            return child
    return None


def test_the_server_dies_with_a_flow_process_killed_by_sigkill(tmp_path):
    """The server is spawned while the flow still imports, and a flow killed without any
    chance to clean up (SIGKILL, the OOM killer) takes it along instead of leaving an
    orphan holding a port and the Prefect database."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.train_charlm", *TINY],
        cwd=tmp_path,
        env={**project_env(tmp_path), "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        flow = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        server = None
        while server is None and time.monotonic() < deadline and proc.poll() is None:
            server = _server_of(flow)
            time.sleep(0.05)
        assert server is not None, "no API server process started by the flow"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs([server], timeout=30)
        assert gone and not alive, f"server {server.pid} outlived its flow"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_no_other_listener_can_take_the_servers_port_while_it_starts(tmp_path):
    """The server's port is bound before its process starts, not by the server once its
    imports are done (seconds later): a flow's LocalCluster, starting in those seconds,
    once got the same port from a bind to port 0, and the flow failed with "temporary API
    server exited with code 3" while its health check talked TLS to a Dask listener."""
    port, server = start_server({**server_env(), "PREFECT_HOME": str(tmp_path)})
    try:
        intruder = socket.socket()
        with pytest.raises(OSError) as taken, intruder:
            intruder.bind(("127.0.0.1", port))  # the server is still importing
        assert taken.value.errno == errno.EADDRINUSE
        assert server.poll() is None, "the server started and stopped before the bind"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health") as answer:
                    assert answer.status == 200
                    break
            except OSError:
                assert server.poll() is None, f"the server exited ({server.returncode})"
                time.sleep(0.2)
        else:
            pytest.fail(f"the server did not answer on port {port} within 120 s")
    finally:
        server.terminate()
        server.wait(30)
