"""How Prefect's temporary API server is started: the command and environment Prefect's own
start uses, on a free loopback port. Standard library only: a flow's command line runs it
before its imports (early_api), and `make venv` to build the database template."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(port: int) -> list[str]:
    """The command Prefect runs for its temporary server, on 127.0.0.1:`port`."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise RuntimeError("Prefect is not installed")
    command = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parents[1])]
    command += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1"]
    return command + ["--port", str(port), "--log-level", "error", "--lifespan", "on"]


def server_env() -> dict[str, str]:
    return {
        **os.environ,
        # What Prefect's own start sets for its temporary server.
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        # The server would otherwise try to send telemetry over a network we may not have.
        "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get(
            "PREFECT_SERVER_ANALYTICS_ENABLED", "false"
        ),
    }
