"""How long one MLflow client call may take before the client gives up on it.

The promotion lock's holder may act only while a waiter cannot yet have declared it dead,
and its last act (setting the alias) is one MLflow call: the lock's lease must outlast the
longest such call. Against a tracking server that is the client's own retry budget: every
attempt may wait `MLFLOW_HTTP_REQUEST_TIMEOUT` seconds, and urllib3 sleeps
`backoff_factor * 2**(n-1)` (at most 120 s) plus up to `backoff_jitter` before retry n.
With MLflow's defaults (120 s, 7 retries, factor 2, jitter 1) that is 960 + 246 + 7 s,
about 20 minutes. A database URI (sqlite, postgresql, ...) is one transaction in this
process, with no retries: `DATABASE_CALL_S` bounds it.
"""

from __future__ import annotations

from urllib.parse import urlparse

from mlflow.environment_variables import (
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR,
    MLFLOW_HTTP_REQUEST_BACKOFF_JITTER,
    MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_TIMEOUT,
)

HTTP_SCHEMES = ("http", "https", "databricks")
# urllib3's cap on one backoff sleep (Retry.DEFAULT_BACKOFF_MAX), which MLflow keeps.
MAX_BACKOFF_S = 120.0
# A registry write in a SQL database: SQLite waits up to 5 s for a writer's lock by default;
# a minute leaves room for a loaded server database.
DATABASE_CALL_S = 60.0


def longest_call_s(tracking_uri: str) -> float:
    """Seconds after which one MLflow call to `tracking_uri` has returned or raised."""
    if urlparse(str(tracking_uri)).scheme not in HTTP_SCHEMES:
        return DATABASE_CALL_S
    retries = max(0, MLFLOW_HTTP_REQUEST_MAX_RETRIES.get())
    factor = max(0.0, float(MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get()))
    jitter = max(0.0, float(MLFLOW_HTTP_REQUEST_BACKOFF_JITTER.get()))
    attempts = (retries + 1) * float(MLFLOW_HTTP_REQUEST_TIMEOUT.get())
    sleeps = sum(min(MAX_BACKOFF_S, factor * 2 ** (n - 1)) + jitter for n in range(1, retries + 1))
    return attempts + sleeps
