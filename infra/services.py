"""Start the local stack's services one by one; each start returns only once it is healthy.

Other tests import these helpers: `free_port`, `Service`, `start_*`, `create_bucket`, `stop`,
`wait_http`. Every process binds 127.0.0.1 and runs in its own session (see `infra.procs`).
Authentication is optional here (tests start bare servers); `infra.stack` always
enables it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpflow.integrations.prefect import db_template as prefect_db_template
from ddpflow.tracking.store import template as mlflow_store_template
from infra.dask_service import dask_workers_seen, start_dask
from infra.procs import (
    Service,
    ServiceError,
    free_port,
    http_ok,
    pid_alive,
    spawn,
    stop,
    tcp_ok,
    wait_http,
    wait_until,
)
from infra.runtime import BIN, REPO, base_env

__all__ = [
    "BIN",
    "REPO",
    "Service",
    "ServiceError",
    "create_bucket",
    "fake_s3_client",
    "free_port",
    "health",
    "start_dask",
    "start_mlflow",
    "start_moto",
    "start_prefect_server",
    "start_prefect_worker",
    "stop",
    "wait_http",
    "base_env",
]

FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Generous on 2 shared cores: Prefect and MLflow spend most of their start-up importing.
SERVER_TIMEOUT_S = 90.0


def start_moto(
    port: int, log_dir: Path, host: str = "127.0.0.1", unauthenticated_actions: int | None = None
) -> Service:
    """moto's S3 server (infra.s3_endpoint) on `host`. It accepts any key, unless
    `unauthenticated_actions` is set: then only that many requests, and every later one must
    carry the key of a user made by them (infra.s3_user)."""
    argv = [str(BIN / "python"), "-m", "infra.s3_endpoint", "-H", host, "-p", str(port)]
    env = base_env()
    if unauthenticated_actions is not None:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(unauthenticated_actions)
    service = spawn("moto", argv, env, log_dir, cwd=REPO)  # where `infra` is importable
    service.url = f"http://{host}:{port}"
    service.extra = {"health_url": f"{service.url}/moto-api/", "port": port}
    return _healthy(service, 30)


def fake_s3_client(endpoint_url: str) -> Any:
    """A boto3 S3 client of the endpoint with moto's fake keys (boto3 types its clients at
    run time)."""
    import boto3  # late: only callers that talk S3 pay for the import

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
        region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
    )


def create_bucket(endpoint_url: str, bucket: str) -> None:
    """Create bucket on the S3 endpoint with moto's fake keys; an existing one is fine."""
    s3 = fake_s3_client(endpoint_url)
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)


def start_mlflow(
    port: int,
    backend_store_uri: str,
    artifacts_destination: str,
    env: Mapping[str, str],
    log_dir: Path,
    host: str = "127.0.0.1",
    auth_env: Mapping[str, str] | None = None,
) -> Service:
    """MLflow tracking server proxying artifacts to artifacts_destination (env reaches S3).

    With `auth_env` (MLFLOW_AUTH_CONFIG_PATH, MLFLOW_FLASK_SERVER_SECRET_KEY) it runs MLflow's
    basic-auth app: every request but /health needs a user and password.
    """
    argv = [
        str(BIN / "mlflow"), "server", "--host", host, "--port", str(port),
        "--backend-store-uri", backend_store_uri,
        "--artifacts-destination", artifacts_destination,
        "--workers", "1",
        *(["--app-name", "basic-auth"] if auth_env else []),
    ]  # fmt: skip
    # Job execution starts a huey consumer and extra workers: 24 s and 2.2 GB instead of 10 s.
    quick = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    full_env = base_env({**env, **quick, **(auth_env or {})})
    if backend_store_uri.startswith("sqlite:///"):
        # A new store starts as a copy of the migrated schema `make venv` built, as a flow's
        # own store does: about 1 CPU-second less than migrating (2026-12-07). An existing
        # store is never replaced. (seed reads its template variable from this process's
        # environment, which base_env's copy for the server lacks.)
        mlflow_store_template.seed(Path(backend_store_uri.removeprefix("sqlite:///")))
    service = spawn("mlflow", argv, full_env, log_dir, cwd=log_dir)
    service.url = f"http://{host}:{port}"
    service.extra = {"health_url": f"{service.url}/health", "port": port}
    return _healthy(service, SERVER_TIMEOUT_S)


def start_prefect_server(
    port: int,
    prefect_home: Path,
    log_dir: Path,
    host: str = "127.0.0.1",
    auth_string: str | None = None,
) -> Service:
    """Prefect API + UI on SQLite; the database lives in prefect_home.

    With `auth_string` ("user:password") the API wants HTTP basic auth, except /health.
    """
    prefect_home.mkdir(parents=True, exist_ok=True)
    argv = [str(BIN / "prefect"), "server", "start", "--host", host, "--port", str(port)]
    settings = {
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # A run queued by a deployment's concurrency limit starts within 5 s of the slot
        # freeing, instead of Prefect's 30 s.
        "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "5",
        # `prefect deployment run --watch` streams the run's logs (its summary included)
        # beside its events; off, Prefect's default, it shows the events alone.
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
        "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
        # The UI's pages call the API at this URL; unset, it is :4200 whatever port was taken.
        "PREFECT_UI_API_URL": f"http://{host}:{port}/api",
    }
    if auth_string:  # in the environment, not argv: `ps` shows argv to every local user
        settings["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    env = base_env(settings)
    # A new home starts on a copy of the migrated database `make venv` built, as a flow's
    # embedded API does: ready in 3.9 s and 5.0 CPU-seconds instead of 9.6 s and 10.1 for a
    # server that migrates a new one (2026-12-07). An existing database is never replaced.
    template = prefect_db_template.TEMPLATE_VARIABLE  # base_env drops it with DDPFLOW_*
    prefect_db_template.seed({**env, template: os.environ.get(template, "")})
    service = spawn("prefect-server", argv, env, log_dir, cwd=prefect_home)
    # uvicorn shuts down cleanly on SIGINT (Ctrl-C), as a terminal would stop it.
    service.stop_signal = int(signal.SIGINT)
    service.url = f"http://{host}:{port}/api"
    service.extra = {"health_url": f"{service.url}/health", "port": port}
    return _healthy(service, SERVER_TIMEOUT_S)


def start_prefect_worker(
    pool: str, env: Mapping[str, str], log_dir: Path, cwd: Path | None = None
) -> Service:
    """A process worker polling pool; env (with PREFECT_API_URL) is passed on to flow runs."""
    full_env = base_env(env)
    if "PREFECT_API_URL" not in full_env:
        raise ValueError("start_prefect_worker needs PREFECT_API_URL in env (the Prefect server)")
    _ensure_pool(pool, full_env)
    name = f"ddpflow-worker-{uuid.uuid4().hex[:8]}"  # unique: a stale record cannot pass health
    argv = [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"]
    service = spawn("prefect-worker", [*argv, "--name", name], full_env, log_dir, cwd=cwd or REPO)
    service.stop_signal = int(signal.SIGINT)  # `prefect worker start` ignores SIGTERM
    service.url = full_env["PREFECT_API_URL"]
    service.extra = {"pool": pool, "worker_name": name}
    return _healthy(service, SERVER_TIMEOUT_S, full_env)


def _ensure_pool(pool: str, env: Mapping[str, str]) -> None:
    """Create the process work pool unless it exists (the CLI fills the base job template)."""
    argv = [str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process"]
    done = subprocess.run(
        argv, env=dict(env), capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0 and "already exists" not in done.stdout + done.stderr:
        raise ServiceError(f"could not create work pool {pool!r}:\n{done.stdout}{done.stderr}")


def _prefect_worker_seen(service: Service, env: Mapping[str, str]) -> bool:
    """True if the Prefect API lists this worker (by its unique name) in its pool."""
    import httpx  # Prefect's own HTTP client; a POST with a JSON body

    pool, name = service.extra["pool"], service.extra["worker_name"]
    url = f"{service.url}/work_pools/{pool}/workers/filter"
    auth = env.get("PREFECT_API_AUTH_STRING")
    login = tuple(auth.split(":", 1)) if auth else None
    resp = httpx.post(url, json={}, timeout=5, trust_env=False, auth=login)
    resp.raise_for_status()
    return any(w["name"] == name for w in resp.json())


def _ui_reaches_api(service: Service) -> bool:
    """True if the Prefect UI is told to call this server's API (its /ui-settings)."""
    import httpx

    settings = httpx.get(
        service.url.removesuffix("/api") + "/ui-settings", timeout=5, trust_env=False
    )
    return settings.json().get("api_url") == service.url


def health(service: Service, env: Mapping[str, str] | None = None) -> str | None:
    """None if the service is healthy, else why not (for `status` and the start-up waits).

    env: the stack's client environment, with the credentials the checks log in with.
    """
    env = env or {}
    if not pid_alive(service.pid, service.create_time or None):
        return "process not running"
    try:
        if service.name == "prefect-worker":
            ok = _prefect_worker_seen(service, env)
        elif service.name == "dask-workers":
            ok = dask_workers_seen(service, env)
        elif service.name == "dask-scheduler":
            ok = tcp_ok("127.0.0.1", service.extra["port"])
        elif service.name == "prefect-server":
            ok = http_ok(service.extra["health_url"]) and _ui_reaches_api(service)
        else:
            ok = http_ok(service.extra["health_url"])
    except Exception as exc:  # any failure to answer is "unhealthy"
        return f"{type(exc).__name__}: {exc}"
    return None if ok else "not ready"


def _healthy(service: Service, timeout_s: float, env: Mapping[str, str] | None = None) -> Service:
    """Wait for health; a service that never gets there is stopped before the error is raised."""
    try:
        if "health_url" in service.extra:
            wait_http(service.extra["health_url"], timeout_s, service)
        else:
            wait_until(lambda: health(service, env) is None, timeout_s, service, "healthy")
    except BaseException:
        stop(service)
        raise
    return service
