"""A Prefect API for the flows a test runs in its own process: Prefect's test harness, on a
copy of the migrated database.

`prefect.testing.utilities.prefect_test_harness` starts its server on an empty database,
which the server first migrates: 13.7 s and about 15 CPU-seconds to start on an idle 2-core
machine (2026-11-29), against 5.2 s and 5.3 CPU-seconds for the same server on a copy of
the migrated template the flows' own embedded API starts from
(ddpflow/integrations/prefect/db_template.py). Each test process starts one server
(`shared_prefect_server` in tests/integration/conftest.py), and each module that needs it
makes it the process's API for its own tests (`api_of_this_process`): one start per process
instead of one per module (in a full run, 27 Prefect server processes in all instead of 40).

What the harness does for the flows is done alike: the server is Prefect's temporary one
(the flows' own start_server), it is this process's PREFECT_API_URL (a setting, so threads
started in a copy of this context see it, and the global settings too, for those that do
not), and before it stops, the flows' last logs and events are sent (otherwise they are
retried against a stopped server for a minute at exit).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from ddpflow.integrations.prefect.db_template import DATABASE_URL_VARIABLES
from ddpflow.integrations.prefect.server import (
    server_env,
    start_server,
    stop_server,
    wait_healthy,
)

STOP_TIMEOUT_S = 10.0
# Each running API's folder (its database inside), by its URL: a test that searches every
# file a run could have written a secret to searches the API's database too.
_HOMES: dict[str, Path] = {}


def database_files(api_url: str) -> list[Path]:
    """The files of a running prefect_server's database (its write-ahead log included)."""
    return sorted(_HOMES[api_url].glob("prefect.db*"))


@contextmanager
def prefect_server(
    template: Path, startup_timeout_s: float = 180, changes: Mapping[str, str | None] | None = None
) -> Iterator[str]:
    """A Prefect server on a copy of `template` (a migrated database) while the block runs;
    yields its API URL. No setting of this process changes: `api_of_this_process` makes it
    the API for a block. `changes` to the server's environment (None removes a variable)."""
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
    port, server = start_server(env)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(f"{url}/health", server, startup_timeout_s)
        _HOMES[url] = home
        yield url
    finally:
        _HOMES.pop(url, None)
        stop_server(server, STOP_TIMEOUT_S)
        shutil.rmtree(home, ignore_errors=True)


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
