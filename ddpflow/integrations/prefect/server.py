"""How Prefect's temporary API server is started: the command and environment Prefect's own
start uses, but on a loopback socket bound before the process starts (start_server).
Standard library only: a flow's command line runs it before its imports (early_api), and
`make venv` to build the database template."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

# uvicorn's own backlog for the sockets it binds.
SOCKET_BACKLOG = 2048


# The write ends of the servers' lifelines (start_server), open until this process ends.
_LIFELINES: list[int] = []

# A server with a lifeline: uvicorn as `python -m uvicorn` runs it, and a thread that reads
# the lifeline, which nothing writes to, so the read returns only once every write end is
# closed: the process that started the server has ended, however it ended (SIGKILL, the OOM
# killer). The thread then sends the server SIGTERM, the signal of an orderly stop
# (stop_server); before uvicorn handles it, SIGTERM ends the process outright.
WITH_LIFELINE = """\
import os, runpy, signal, sys, threading
lifeline = int(sys.argv.pop(1))
def watch():
    os.read(lifeline, 1)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch, name="lifeline", daemon=True).start()
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""


def start_server(
    env: Mapping[str, str], die_with_this_process: bool = False
) -> tuple[int, subprocess.Popen[bytes]]:
    """Prefect's temporary server in a process of its own: its port and the process.

    The server listens on a socket bound here, inherited by the process (uvicorn's --fd),
    not on a port number it would bind itself seconds later, once its imports are done: in
    that window any bind to port 0 on the machine may be handed the same port (the flow's
    own LocalCluster starts in it), and the server then exits at start (code 3) while its
    health check talks to the other listener.

    With `die_with_this_process` the server also gets a lifeline: the read end of a pipe
    whose only write end this process keeps (not inherited by the processes it starts), so
    the server stops when this process ends, also without an orderly stop (WITH_LIFELINE).
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(SOCKET_BACKLOG)
        lifeline = None
        if die_with_this_process:
            lifeline, write_end = os.pipe()
            _LIFELINES.append(write_end)
        try:
            process = subprocess.Popen(
                server_command(sock.fileno(), lifeline),
                env=dict(env),
                pass_fds=(sock.fileno(),) if lifeline is None else (sock.fileno(), lifeline),
            )
        finally:
            if lifeline is not None:
                os.close(lifeline)  # the server's copy is the only read end
        return sock.getsockname()[1], process  # the server's copy stays open


def server_command(fd: int, lifeline: int | None = None) -> list[str]:
    """The command Prefect runs for its temporary server, on the listening socket `fd`; with
    the read end of a `lifeline`, the server ends when that pipe closes (WITH_LIFELINE)."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise RuntimeError("Prefect is not installed")
    if lifeline is None:
        command = [sys.executable, "-m", "uvicorn"]
    else:
        command = [sys.executable, "-c", WITH_LIFELINE, str(lifeline)]
    command += ["--app-dir", str(Path(spec.origin).parents[1])]
    command += ["--factory", "prefect.server.api.server:create_app", "--fd", str(fd)]
    return command + ["--log-level", "error", "--lifespan", "on"]


# Prefect registers every block type at each server start, importing every installed Prefect
# collection first (prefect_dask, so Dask too): 1.4 of the 4.7 CPU-seconds a start took
# (2026-11-30). The database template has them registered once (db_template.build turns
# this back on), and Block.save registers a type it lacks, so the servers a flow starts
# skip the pass.
BLOCK_REGISTRATION = (
    "PREFECT_API_BLOCKS_REGISTER_ON_START",
    "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION",
)


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
        **{name: os.environ.get(name, "false") for name in BLOCK_REGISTRATION},
    }


def wait_healthy(url: str, server: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Wait until the server answers its health `url`; RuntimeError if it exits first or
    does not answer within `timeout_s`. `server` None: a server another process started,
    whose exit this one cannot see."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"Prefect's server exited with code {server.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
            if answer.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"Prefect's server did not answer {url} within {timeout_s:g} s")


def stop_server(server: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Stop the server as Prefect stops its temporary one: SIGTERM, then SIGKILL after
    `timeout_s`."""
    server.terminate()
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
