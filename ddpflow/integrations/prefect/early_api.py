"""Start the flow's embedded Prefect API while the flow's own imports are still loading.

`python -m flows.<name>` without PREFECT_API_URL runs on an API server of its own: Prefect
would start its temporary ("ephemeral") one when the flow is called, after this process has
imported MLflow and Prefect (seconds), and then wait for the server's own start (seconds
more, as it imports Prefect's server in a process of its own). Started here, by
`start_services()` at the top of the flow module's `__main__` guard, before any of those
imports, the two overlap on separate cores.

The server is the one Prefect would start (same command, same settings: server.py). Its URL
is put in this process's environment as PREFECT_API_URL before Prefect is imported, so
Prefect takes it as its API from the start: it never starts a temporary server of its own,
and never imports its server application (ORM models, schemas: 4-9 CPU s on 2 busy cores)
into the flow process, which Prefect's own temporary server does even when it only waits
for one. The flow's workers get the same URL. It stays the flow's own server all the same:
`embedded_url()` tells it from a server the user set (pre-flight's message, what workers on
other hosts are handed), no "View at" link points at it (it has no UI and stops with the
flow), and it stops when this process exits, or dies with it.

Imports of a flow module (tests, `prefect deploy`, a worker running a deployment, which
has PREFECT_API_URL) do not run that guard, and start nothing; a flow called from Python
runs on Prefect's own temporary server, as any Prefect flow does.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ddpflow.integrations.prefect.server import server_env, start_server, stop_server

# The embedded API's URL, for the flow's worker processes (which inherit it): theirs is
# PREFECT_API_URL too, but it is no server shared with other flows (promotion_limit).
EMBEDDED_API_ENV = "DDPFLOW_EMBEDDED_PREFECT_API_URL"
STOP_TIMEOUT_S = 5.0  # what Prefect's own temporary server is given to stop

_started: tuple[int, subprocess.Popen[bytes]] | None = None
_seeded: Path | None = None  # the database copied from the template, if one was
_answered = False  # whether the server answered (wait_until_ready), for the stop line


def wanted(args: list[str], environ: Mapping[str, str]) -> bool:
    """Whether a flow's command line (its arguments `args`) will run on the embedded API."""
    return not environ.get("PREFECT_API_URL") and not {"-h", "--help"} & set(args)


def start_services(args: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> None:
    """Called first in a flow module's `__main__` guard: start the embedded API and, once its
    address is known, the flow's LocalCluster, while the module's imports load."""
    if not wanted(sys.argv[1:] if args is None else args, environ):
        return
    start_early()
    if url := embedded_url():
        from ddpflow.integrations.prefect import (
            early_cluster,  # imports distributed: only on this path
        )

        early_cluster.start_early(url)


def start_early() -> None:
    """Spawn the server process now (no waiting) and make its URL this process's API.

    Nothing is started once Prefect is imported: it has read its settings, so it would not
    see the URL, and starts its own temporary server as for any flow."""
    global _started, _seeded
    if importlib.util.find_spec("prefect") is None or "prefect" in sys.modules:
        return
    # A first run in this PREFECT_HOME: the migrated database from the install, not 5 s of
    # migrations. Imported here: `python -m` of that module must not find it imported.
    from ddpflow.integrations.prefect import db_template

    _seeded = db_template.seed()
    # With a lifeline: no server outlives its flow, also one killed without an orderly exit.
    _started = start_server(server_env(), die_with_this_process=True)
    atexit.register(_stop)
    os.environ["PREFECT_API_URL"] = os.environ[EMBEDDED_API_ENV] = f"{_address(_started[0])}/api"
    # No "View at <UI>" links: the server serves no UI and is gone once the flow ends.
    os.environ["PREFECT_UI_URL"] = ""


def _address(port: int) -> str:
    """The server's address (its API is under /api), as Prefect's temporary server logs it."""
    return f"http://127.0.0.1:{port}"


def embedded_url() -> str | None:
    """The embedded server's API URL, when this process started one (else None)."""
    return None if _started is None else f"{_address(_started[0])}/api"


def wait_until_ready() -> None:
    """Wait until the embedded server answers, before the flow's first call to its API
    (Prefect's client does not retry a first connection). A no-op when none was started."""
    global _answered
    if _started is None:
        return
    port, process = _started
    from prefect.logging import get_logger

    logger = get_logger()  # "prefect", where Prefect's own temporary server logs its lines
    logger.info(f"Starting temporary server on {_address(port)}")
    if _seeded is not None:
        from ddpflow.integrations.prefect.db_template import SEEDED_FROM

        logger.info(f"Prefect's temporary server: {SEEDED_FROM} to {_seeded}")
    _wait_healthy(f"{_address(port)}/api", process)
    _answered = True


def _stop() -> None:
    """At exit: stop the server as Prefect stops its temporary one (SIGTERM, then SIGKILL).
    Registered before Prefect is imported, so it runs after Prefect's own exit handlers
    (they send the last logs and events to this server)."""
    if _started is None:
        return
    port, process = _started
    if _answered:
        from prefect.logging import get_logger

        get_logger().info(f"Stopping temporary server on {_address(port)}")
    stop_server(process, STOP_TIMEOUT_S)


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
    raise RuntimeError(
        f"Prefect's temporary API server did not answer within "
        f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()} s "
        "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
    )
