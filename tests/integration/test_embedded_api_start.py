"""The embedded Prefect API a flow's command line starts early
(ddpflow/integrations/prefect/early_api.py): real processes, `python -m flows.train_charlm`
and its uvicorn server, no mocks."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from prefect import get_client

from ddpflow.integrations.prefect.server import (
    server_env,
    start_server,
    stop_server,
    wait_healthy,
)
from tests.helpers.charlm_runs import TINY
from tests.helpers.paths import CHECKOUT
from tests.helpers.prefect_harness import api_of_this_process
from tests.helpers.projects import project_env

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
        env={**project_env(tmp_path), "PYTHONPATH": str(CHECKOUT)},
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


def test_a_secret_block_saves_and_loads_on_a_server_that_skips_block_registration(tmp_path):
    """The servers a flow starts skip Prefect's registration of every block type at start
    (ddpflow.integrations.prefect.server.BLOCK_REGISTRATION; the database template has the
    types). On a fresh database, without the template, a Secret block still saves (saving
    registers its type) and loads."""
    from prefect.blocks.system import Secret

    port, server = start_server({**server_env(), "PREFECT_HOME": str(tmp_path)})
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(f"{url}/health", server, 120)
        with api_of_this_process(url):
            Secret(value="not-a-real-secret").save("ddpflow-test")
            assert Secret.load("ddpflow-test").get() == "not-a-real-secret"
            with get_client(sync_client=True) as client:
                types = {t.slug for t in client.read_block_types()}
        assert "secret" in types
        assert "local-file-system" not in types, "the server registered every block type"
    finally:
        stop_server(server, 30)


# A flow run the way a flow's command line runs one (start_early before Prefect is
# imported, wait_until_ready before the call), in a process of its own.
EMBEDDED_RUN = """
import sys
from ddpflow.integrations.prefect import early_api
early_api.start_early()
from prefect import flow, get_client
from ddpflow.integrations.prefect.task_runner import configured_api_url, prefect_api_url
early_api.wait_until_ready()

@flow
def answer() -> int:
    return 42

assert answer() == 42
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs()
print("runs", [run.state.type.value for run in runs])
print("api", prefect_api_url() == early_api.embedded_url(), configured_api_url())
print("server app imported", "prefect.server.api.server" in sys.modules)
"""


def test_a_command_lines_flow_runs_on_its_embedded_api_without_prefects_server_app(tmp_path):
    """The embedded server is the flow's API from the start (PREFECT_API_URL, set before
    Prefect is imported): the run is recorded there, Prefect's server application (4-9 CPU
    s) is never imported into the flow process, the server still counts as the flow's own
    (not a configured server), no "View at" link points at a server that stops with the
    flow, and it stops at exit."""
    done = subprocess.run(
        [sys.executable, "-c", EMBEDDED_RUN],
        cwd=tmp_path,
        env=project_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "runs ['COMPLETED']" in output, output[-3000:]
    assert "api True None" in output, output[-3000:]
    assert "server app imported False" in output, output[-3000:]
    assert "View at" not in output, output[-3000:]
    started = re.search(r"Starting temporary server on http://127\.0\.0\.1:(\d+)", output)
    assert started, output[-3000:]
    assert f"Stopping temporary server on http://127.0.0.1:{started[1]}" in output, output
    with pytest.raises(OSError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", int(started[1])), timeout=5).close()
