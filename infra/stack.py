"""The local production-like stack: `python -m infra.stack up|down|status`.

`up` starts SeaweedFS (S3), an MLflow server, a Prefect server, a Dask scheduler with N workers
and a Prefect process worker, all on 127.0.0.1, each health-checked before the next starts. Every
server wants credentials, made at `up` (see `infra.auth`). S3's objects stay in `<dir>/s3`
from one `up` to the next, as MLflow's runs do in `<dir>/mlflow.db`.
Tests use `start_stack` / `stop_stack` directly.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from infra import procs, services
from infra.auth import StackSecrets
from infra.procs import Service, ServiceError, members, pid_alive, port_is_free, process_start
from infra.seaweedfs.server import start_seaweedfs
from infra.state import BUCKET, WORK_POOL, StackError, StackState, client_env, summary

DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "s3": 9000, "dask": 8786}
# Prefect's default poll is 10 s; 2 s makes `prefect deployment run` start promptly here.
WORKER_QUERY_SECONDS = "2"


def choose_ports(free_ports: bool) -> dict[str, int]:
    """The default ports if they are all free, else fail; with free_ports, OS-picked ones."""
    if free_ports:
        return procs.free_ports(DEFAULT_PORTS)
    busy = [f"{port} ({name})" for name, port in DEFAULT_PORTS.items() if not port_is_free(port)]
    if busy:
        raise StackError(
            f"port(s) {', '.join(busy)} already in use on 127.0.0.1; stop what uses them "
            "or pass --free-ports to pick free ports"
        )
    return dict(DEFAULT_PORTS)


def _refuse_running(stack_dir: Path) -> None:
    """One stack per folder: a live one must be stopped first; a dead record is replaced."""
    old = StackState.load(stack_dir)
    if old and any(pid_alive(s.pid, s.create_time or None) for s in old.services):
        raise StackError(
            f"a stack is already running in {stack_dir} "
            f"(python -m infra.stack status/down --dir {stack_dir})"
        )


def _timed(state: StackState, start: Callable[[], Service | tuple[Service, ...]]) -> None:
    """Run one start function and record its service(s) with the time it took."""
    began = time.monotonic()
    started = start()
    for service in started if isinstance(started, tuple) else (started,):
        state.add(service, time.monotonic() - began)


def start_stack(stack_dir: Path, num_workers: int = 2, free_ports: bool = False) -> StackState:
    """Start every service in order; on any failure stop what started and raise."""
    began = time.monotonic()
    stack_dir = Path(stack_dir).resolve()
    stack_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # 0700 when new: logs, databases
    _refuse_running(stack_dir)
    ports = choose_ports(free_ports)
    state = StackState(dir=stack_dir, ports=ports, env=client_env(ports))
    secrets = StackSecrets.create(state.secrets_dir)
    state.env.update(secrets.client_env())
    logs = state.log_dir
    try:
        _timed(
            state,
            lambda: start_seaweedfs(
                ports["s3"],
                stack_dir / "s3",
                secrets.seaweedfs_dir,
                logs,
                secrets.s3_identities(BUCKET),
                buckets=(BUCKET,),
            ),
        )
        s3 = {k: v for k, v in state.env.items() if k.startswith("AWS_")}
        # Everything that runs user code gets the full client env, so flow runs and ranks see it.
        runtime_env = {
            **state.env,
            "PREFECT_HOME": str(stack_dir / "prefect"),
            "PYTHONPATH": str(services.REPO),
        }
        _timed(
            state,
            lambda: services.start_mlflow(
                ports["mlflow"],
                f"sqlite:///{stack_dir / 'mlflow.db'}",
                f"s3://{BUCKET}/mlflow",
                s3,
                logs,
                auth_env=secrets.mlflow_server_env(),
            ),
        )
        _timed(
            state,
            lambda: services.start_prefect_server(
                ports["prefect"],
                stack_dir / "prefect",
                logs,
                auth_string=secrets.prefect_auth_string,
            ),
        )
        _timed(
            state,
            lambda: services.start_dask(
                ports["dask"], num_workers, runtime_env, logs, tls=secrets.tls
            ),
        )
        worker_env = {
            **runtime_env,
            "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_SECONDS,
            # Deployment runs get the worker's environment: the same API retries as
            # `python -m flows...` runs get (flows/cli.py, CLIENT_MAX_RETRIES), so a
            # Prefect server restart does not fail them.
            "PREFECT_CLIENT_MAX_RETRIES": "8",
        }
        _timed(state, lambda: services.start_prefect_worker(WORK_POOL, worker_env, logs))
    except BaseException:
        _stop_all(state.services)
        state.remove_files()
        raise
    state.total_startup_s = round(time.monotonic() - began, 2)
    state.save()
    state.write_env_file()
    return state


def _stop_all(started: list[Service]) -> list[str]:
    """Stop services in reverse start order (the Prefect worker first); return the errors."""
    errors = []
    for service in reversed(started):
        try:
            services.stop(service)
        except ServiceError as exc:
            errors.append(str(exc))
    return errors


def stop_stack(stack_dir: Path) -> bool:
    """Stop the stack recorded in stack_dir; False if there was none. Raises if a pid survives."""
    state = StackState.load(stack_dir)
    if state is None:
        return False
    # Snapshot every process now: once a leader dies its children can no longer be found by tree.
    snapshot = [(p.pid, process_start(p)) for s in state.services for p in _safe_members(s)]
    errors = _stop_all(state.services)
    survivors = [pid for pid, created in snapshot if pid_alive(pid, created)]
    if survivors:
        errors.append(f"processes still alive after stop: {survivors}")
    if errors:
        raise StackError("the stack did not stop cleanly:\n" + "\n".join(errors))
    state.remove_files()
    return True


def _safe_members(service: Service) -> list[psutil.Process]:
    try:
        return members(service)
    except Exception:  # a process may vanish while we look
        return []


def stack_status(stack_dir: Path) -> list[tuple[Service, str | None]]:
    """Each recorded service with None if healthy, else why not."""
    state = StackState.load(stack_dir)
    if state is None:
        raise StackError(f"no stack recorded in {Path(stack_dir).resolve()} (state.json missing)")
    return [(service, services.health(service, state.env)) for service in state.services]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.stack", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=Path(".stack"), help="state, logs, databases")
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes (up)")
    parser.add_argument("--free-ports", action="store_true", help="pick free ports (up)")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            if args.workers < 1:
                parser.error(f"--workers must be at least 1, got {args.workers}")
            print(summary(start_stack(args.dir, args.workers, args.free_ports)))
        elif args.command == "down":
            stopped = stop_stack(args.dir)
            where = args.dir.resolve()
            print(f"stack in {where} stopped" if stopped else f"no stack recorded in {where}")
        else:
            rows = stack_status(args.dir)
            print(f"{'service':<16}{'pid':>8}  {'url':<32}  health")
            for service, problem in rows:
                print(f"{service.name:<16}{service.pid:>8}  {service.url:<32}  {problem or 'ok'}")
            return 0 if all(problem is None for _, problem in rows) else 1
    except (StackError, ServiceError) as exc:
        print(f"infra.stack {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
