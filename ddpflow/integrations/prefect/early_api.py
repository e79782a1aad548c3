"""Start Prefect's embedded API while the flow's own imports are still loading.

`python -m flows.<name>` without PREFECT_API_URL runs on Prefect's temporary ("ephemeral")
API server, which Prefect starts when the flow is called: after this process has imported
torch, MLflow and Prefect (seconds), and then it waits for the server's own start (seconds
more, as it imports Prefect's server in a process of its own). Started here, by
`start_services()` at the top of the flow module's `__main__` guard, before any of those
imports, the two overlap on separate cores.

The server is the one Prefect would start (same command, same settings) and is handed to
Prefect's own singleton (`adopt`), so everything after behaves as with Prefect's start:
the flow and its workers use it as the embedded API, and it stops when the flow exits.
Imports of a flow module (tests, `prefect deploy`, a worker running a deployment, which
has PREFECT_API_URL) do not run that guard, and start nothing.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ddpflow.integrations.prefect.server import server_env, start_server

_PR_SET_PDEATHSIG = 1

_started: tuple[int, subprocess.Popen[bytes]] | None = None
_seeded: Path | None = None  # the database copied from the template, if one was


def wanted(args: list[str], environ: Mapping[str, str]) -> bool:
    """Whether a flow's command line (its arguments `args`) will run on the embedded API."""
    return not environ.get("PREFECT_API_URL") and not {"-h", "--help"} & set(args)


def start_services(args: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> None:
    """Called first in a flow module's `__main__` guard: start the embedded API and, once its
    address is known, the flow's LocalCluster, while the module's imports load."""
    if not wanted(sys.argv[1:] if args is None else args, environ):
        return
    start_early()
    if url := api_url():
        from ddpflow.integrations.prefect import (
            early_cluster,  # imports distributed: only on this path
        )

        early_cluster.start_early(url)


def _die_with_parent() -> None:
    """In the server process: SIGTERM it when the flow process dies, even by SIGKILL,
    so no server outlives its flow (Prefect's own start stops it only at a clean exit)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_early() -> None:
    """Spawn the server process now (no waiting); `adopt` hands it to Prefect later."""
    global _started, _seeded
    if importlib.util.find_spec("prefect") is None:
        return
    # A first run in this PREFECT_HOME: the migrated database from the install, not 5 s of
    # migrations. Imported here: `python -m` of that module must not find it imported.
    from ddpflow.integrations.prefect import db_template

    _seeded = db_template.seed()
    preexec = _die_with_parent if sys.platform == "linux" else None
    _started = start_server(server_env(), preexec)
    atexit.register(_stop_unadopted)


def api_url() -> str | None:
    """The early server's API URL (what Prefect's temporary server reports), if started."""
    return None if _started is None else f"http://127.0.0.1:{_started[0]}/api"


def _stop_unadopted() -> None:
    """At exit before `adopt` (e.g. a command-line error): the server is not needed."""
    if _started is not None:
        _started[1].terminate()


def adopt() -> None:
    """Make the early server Prefect's temporary server: Prefect's start() then only waits
    for its health check instead of spawning another. A no-op when none was started."""
    global _started
    if _started is None:
        return
    port, process = _started
    _started = None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if server.running or process.poll() is not None:
        process.terminate()  # Prefect's own start takes over
        return
    server.port = port
    server.server_process = process
    # Prefect's start() skips the spawn when `running` is set, so wait for health here.
    from prefect.logging import get_logger

    get_logger("server").info(f"Starting temporary server on {server.address}")
    if _seeded is not None:  # Prefect's "prefect" logger: the server's is quiet at INFO
        from ddpflow.integrations.prefect.db_template import SEEDED_FROM

        get_logger().info(f"Prefect's temporary server: {SEEDED_FROM} to {_seeded}")
    _wait_healthy(server.api_url, process)
    server.running = True
    atexit.register(server.stop)


def _wait_healthy(api_url: str, process: subprocess.Popen[bytes]) -> None:
    import time

    import httpx
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"Prefect's temporary API server exited with code {process.returncode} "
                    "before it answered; run `prefect server start` and set PREFECT_API_URL"
                )
            try:
                if client.get(f"{api_url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    process.terminate()
    raise RuntimeError(
        f"Prefect's temporary API server did not answer within "
        f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()} s "
        "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
    )
