"""A migrated Prefect database, built once per install, for a flow's first embedded API.

The first start of Prefect's temporary API server in a new PREFECT_HOME creates its SQLite
database: every migration, then the block types. That is 5-6 s of a cold flow's 8-9 s before
its body runs, against under 3 s for a server that finds the database there. The database it
leaves holds nothing but the schema and the block types of that Prefect version (no runs, no
ids of its own), so it can be made once and copied:

- `python -m ddpflow.integrations.prefect.db_template` (run by `make venv`) starts a server in a
  throw-away PREFECT_HOME, stops it and keeps its database as the template, named by Prefect's
  version, under the environment's prefix (`<venv>/share/ddpflow/`);
- a flow's command line that starts the embedded API copies the template to
  `$PREFECT_HOME/prefect.db` when no database is there yet (`seed`), so its server starts as
  fast as on a second run. Where the database is configured elsewhere, or there is one
  already, or no template of this Prefect version, nothing is copied and Prefect creates its
  database as usual.

Stdlib only (ddpflow.sqlite_template is too): this runs before the flow's own imports.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ddpflow.integrations.prefect.server import (
    BLOCK_REGISTRATION,
    server_env,
    start_server,
    wait_healthy,
)
from ddpflow.sqlite_template import copy_into_place, installed_path, vacuum_into

# Either names a database other than PREFECT_HOME/prefect.db: then that is Prefect's database.
DATABASE_URL_VARIABLES = (
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
)
TEMPLATE_VARIABLE = "DDPFLOW_PREFECT_DB_TEMPLATE"  # another template file, for tests and images
BUILD_TIMEOUT_S = 120.0
SEEDED_FROM = "database copied from the installed template"


def template_path(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The template for the installed Prefect, whether or not it exists; None without Prefect."""
    return installed_path("prefect", TEMPLATE_VARIABLE, environ)


def database_path(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where Prefect's server keeps its database by default; None where one is configured."""
    if any(environ.get(name) for name in DATABASE_URL_VARIABLES):
        return None
    home = environ.get("PREFECT_HOME") or "~/.prefect"
    return Path(home).expanduser() / "prefect.db"


def seed(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Copy the template to Prefect's database path if there is no database yet; the path
    copied to, or None. Never replaces a database (ddpflow.sqlite_template.copy_into_place)."""
    target, template = database_path(environ), template_path(environ)
    if target is None or template is None:
        return None
    # 0700: the folder as Prefect makes PREFECT_HOME.
    return target if copy_into_place(template, target, folder_mode=0o700) else None


def build(target: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Start Prefect's server in a throw-away home, stop it, keep its database at `target`
    (by default where `seed` looks: DDPFLOW_PREFECT_DB_TEMPLATE, else the installed one)."""
    target = target or template_path()
    if target is None:
        raise RuntimeError("Prefect is not installed: there is no database to make")
    with tempfile.TemporaryDirectory(prefix="ddpflow-prefect-home-") as home:
        env = {**server_env(), "PREFECT_HOME": home}  # the server a flow starts, elsewhere
        env.update(dict.fromkeys(BLOCK_REGISTRATION, "true"))  # the template has the blocks
        for name in (*DATABASE_URL_VARIABLES, TEMPLATE_VARIABLE):
            env.pop(name, None)
        port, server = start_server(env)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/api/health", server, timeout_s)
        finally:
            server.terminate()
            server.wait(30)
        vacuum_into(Path(home) / "prefect.db", target)
    return target


if __name__ == "__main__":
    print(f"Prefect database template: {build()}")
