"""A Prefect API for the flows a test runs in its own process: Prefect's test harness, on a
copy of the migrated database.

`prefect.testing.utilities.prefect_test_harness` starts its server on an empty database,
which the server first migrates: 13.7 s and about 15 CPU-seconds to start on an idle 2-core
machine (2026-11-29), against 5.2 s and 5.3 CPU-seconds for the same server on a copy of
the migrated template the flows' own embedded API starts from
(ddpflow/integrations/prefect/db_template.py). A run starts one such server for all its
tests: xdist's controller starts it and hands it to each test process (tests/conftest.py;
a run without xdist starts one in its process), `shared_prefect_server` in
tests/integration/conftest.py, and each module that needs it makes it the process's API for
its own tests (`api_of_this_process`).

What the harness does for the flows is done alike: the server is Prefect's temporary one
(the flows' own start_server), it is this process's PREFECT_API_URL (a setting, so threads
started in a copy of this context see it, and the global settings too, for those that do
not), and before it stops, the flows' last logs and events are sent (otherwise they are
retried against a stopped server for a minute at exit).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ddpflow.integrations.prefect.db_template import DATABASE_URL_VARIABLES
from ddpflow.integrations.prefect.server import (
    server_env,
    start_server,
    stop_server,
    wait_healthy,
)

STOP_TIMEOUT_S = 10.0
# The key of xdist's workerinput under which the controller hands each test process the
# run's shared server (tests/conftest.py, `shared_prefect_server`).
SHARED_PREFECT_API = "ddpflow_shared_prefect_api"
# Each running API's folder (its database inside), by its URL: a test that searches every
# file a run could have written a secret to searches the API's database too.
_HOMES: dict[str, Path] = {}


def database_files(api_url: str) -> list[Path]:
    """The files of a running prefect_server's database (its write-ahead log included)."""
    return sorted(_HOMES[api_url].glob("prefect.db*"))


@dataclass(frozen=True)
class StartedServer:
    """A Prefect server started on a copy of a migrated database: its API URL, its folder
    (the database inside) and its process."""

    url: str
    home: Path
    process: subprocess.Popen[bytes]


def start_prefect_server(
    template: Path,
    changes: Mapping[str, str | None] | None = None,
    die_with_this_process: bool = False,
) -> StartedServer:
    """Start a Prefect server on a copy of `template` (a migrated database) without waiting
    for it to answer: its socket is bound, so its URL holds already. `changes` to the
    server's environment (None removes a variable); `die_with_this_process`: it stops when
    this process ends, however it ends (start_server's lifeline)."""
    home = Path(tempfile.mkdtemp(prefix="ddpflow-test-prefect-"))
    shutil.copyfile(template, home / "prefect.db")
    env = {**server_env(), "PREFECT_HOME": str(home)}
    for name in DATABASE_URL_VARIABLES:
        env.pop(name, None)
    for name, value in (changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    port, process = start_server(env, die_with_this_process)
    return StartedServer(f"http://127.0.0.1:{port}/api", home, process)


def stop_prefect_server(server: StartedServer) -> None:
    _HOMES.pop(server.url, None)
    stop_server(server.process, STOP_TIMEOUT_S)
    shutil.rmtree(server.home, ignore_errors=True)


def adopt_prefect_server(url: str, home: Path, timeout_s: float = 180) -> str:
    """A server another process started (the xdist controller's, `shared_prefect_server`)
    as one this process knows: wait until it answers, remember its database's folder."""
    wait_healthy(f"{url}/health", None, timeout_s)
    _HOMES[url] = home
    return url


@contextmanager
def prefect_server(
    template: Path, startup_timeout_s: float = 180, changes: Mapping[str, str | None] | None = None
) -> Iterator[str]:
    """A Prefect server on a copy of `template` (a migrated database) while the block runs;
    yields its API URL. No setting of this process changes: `api_of_this_process` makes it
    the API for a block. `changes` to the server's environment (None removes a variable)."""
    server = start_prefect_server(template, changes)
    try:
        wait_healthy(f"{server.url}/health", server.process, startup_timeout_s)
        _HOMES[server.url] = server.home
        yield server.url
    finally:
        stop_prefect_server(server)


@contextmanager
def api_of_this_process(url: str) -> Iterator[str]:
    """The Prefect API at `url` (a server running elsewhere) as this process's while the
    block runs; the flows' last logs and events are sent to it before the block ends."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: url}),
        _temporary_global_settings_context(get_settings_context()),
    ):
        yield url
        with contextlib.suppress(RuntimeError):  # no log worker was started
            APILogWorker.instance().drain()
        EventsWorker.drain_all()
