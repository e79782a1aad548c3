"""What the dashboards of the clusters ddpflow starts serve: Dask's, less its /info pages.

A scheduler's dashboard is plain HTTP without authentication, on TLS clusters too (mutual
TLS covers the scheduler's comm port, not its HTTP server), so every user of the machine
(or of the network, where it listens there) can read it. Its /info pages
(`distributed.http.scheduler.info`) serve every failed task's exception text and traceback,
the workers' and scheduler's logs and the call stacks of running tasks: whatever a library
quoted in an error, credentials in a URL included. ddpflow redacts a rank's error before
Dask keeps it, but not what other tasks or libraries log; so the clusters ddpflow starts
serve the dashboard's plots, /health, /metrics and /json without those pages, unless
DDPFLOW_DASHBOARD_INFO=1 asks for them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import dask

from ddpflow.config import DASHBOARD_INFO_ENV

ROUTES_KEY = "distributed.scheduler.http.routes"
INFO_ROUTES = "distributed.http.scheduler.info"


def scheduler_http_routes(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Dask config for the scheduler a cluster starts: its HTTP routes, /info left out
    unless DDPFLOW_DASHBOARD_INFO=1."""
    routes = list(dask.config.get(ROUTES_KEY))
    if environ.get(DASHBOARD_INFO_ENV, "").strip() != "1":
        routes = [route for route in routes if route != INFO_ROUTES]
    return {ROUTES_KEY: routes}
