"""The stack's Dask scheduler and workers, with mutual TLS when given certificates."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ddpflow.cluster.workers import WORKER_CLI_ARGS, WORKER_ENV
from infra.certs import TlsFiles, security_from_env
from infra.procs import Service, spawn, stop, tcp_ok, wait_until
from infra.runtime import BIN, base_env

# No bokeh here, so no dashboard; its HTTP server (health, metrics) still starts, on
# 0.0.0.0:8787 unless told otherwise.
LOOPBACK_HTTP = ["--no-dashboard", "--dashboard-address", "127.0.0.1:0"]


def start_dask(
    scheduler_port: int,
    num_workers: int,
    env: Mapping[str, str],
    log_dir: Path,
    local_directory: Path | None = None,
    tls: TlsFiles | None = None,
) -> tuple[Service, Service]:
    """A Dask scheduler and num_workers worker processes (1 thread each, under nannies).

    With `tls`, every Dask link is mutual TLS: the address is tls://, and a connection
    without a certificate from the same CA is refused.
    """
    protocol = "tls" if tls else "tcp"
    address = f"{protocol}://127.0.0.1:{scheduler_port}"
    # ddpflow.cluster.workers.WORKER_ENV: non-daemonic, no profiler, slower health checks, no
    # malloc env; a setting in env wins (a test starts workers with Dask's profiler on, as
    # a plain `dask worker` has it).
    # The TLS settings in env also make the workers' own clients (get_client) use TLS.
    dask_env = base_env({**WORKER_ENV, **env, **(tls.dask_env() if tls else {})})
    tls_args = ["--protocol", "tls", *tls.cli_args()] if tls else []
    argv = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(scheduler_port)]
    scheduler = spawn("dask-scheduler", [*argv, *tls_args, *LOOPBACK_HTTP], dask_env, log_dir)
    scheduler.url = address
    scheduler.extra = {"port": scheduler_port}
    wait_until(lambda: tcp_ok("127.0.0.1", scheduler_port), 60, scheduler, "listening")
    scratch = local_directory or log_dir.parent / "dask-scratch"
    argv = [
        str(BIN / "dask"), "worker", address, "--nworkers", str(num_workers), "--nthreads", "1",
        "--host", "127.0.0.1", *LOOPBACK_HTTP, "--local-directory", str(scratch),
        *WORKER_CLI_ARGS,
        *(tls.cli_args() if tls else []),
    ]  # fmt: skip
    try:
        workers = spawn("dask-workers", argv, dask_env, log_dir)
    except BaseException:
        stop(scheduler)
        raise
    workers.url = address
    workers.extra = {"num_workers": num_workers}
    try:
        wait_until(lambda: dask_workers_seen(workers, dask_env), 90, workers, "healthy")
        return scheduler, workers
    except BaseException:
        stop(workers)
        stop(scheduler)
        raise


def dask_workers_seen(service: Service, env: Mapping[str, str] | None = None) -> bool:
    """True if the scheduler knows the expected number of workers (TLS settings from env)."""
    import distributed  # late: the other services do not need it

    security = security_from_env(env or {})
    with distributed.Client(service.url, timeout=10, security=security) as client:
        return len(client.nthreads()) >= service.extra["num_workers"]
