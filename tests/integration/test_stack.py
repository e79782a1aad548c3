"""The local stack starts, reports healthy, and stops leaving no process behind."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import distributed
import httpx
import psutil
import pytest

from infra import services, stack
from infra.procs import ServiceError, pid_alive, spawn, wait_http
from infra.state import BUCKET, START_ORDER, WORK_POOL, StackError, StackState

pytestmark = pytest.mark.integration

NUM_WORKERS = 2


def stack_processes(state: StackState) -> dict[int, float]:
    """pid -> start time of every process in the stack's groups and process trees."""
    found: dict[int, float] = {}
    groups = {service.pid for service in state.services}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups:
                found[proc.pid] = proc.create_time()
        except (OSError, psutil.Error):
            continue
    for service in state.services:
        try:
            leader = psutil.Process(service.pid)
            for proc in [leader, *leader.children(recursive=True)]:
                found[proc.pid] = proc.create_time()
        except psutil.Error:
            continue
    return found


def listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP socket these processes listen on."""
    return [
        (conn.pid, conn.laddr.ip, conn.laddr.port)
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids
    ]


def port_listened(port: int) -> bool:
    return any(
        conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
        for conn in psutil.net_connections(kind="tcp")
    )


@pytest.fixture(scope="module")
def stack_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    stack_dir = tmp_path_factory.mktemp("stack")
    state = stack.start_stack(stack_dir, num_workers=NUM_WORKERS, free_ports=True)
    try:
        yield state
    finally:
        stack.stop_stack(stack_dir)  # no-op if the last test already stopped it


@pytest.mark.timeout(240)
def test_every_service_is_healthy(stack_state: StackState, monkeypatch: pytest.MonkeyPatch):
    def dask_settings() -> tuple[bool, bool, str, str | None]:
        import dask  # runs on each worker (nested, so cloudpickle ships it by value)

        return (
            dask.config.get("distributed.worker.daemon"),
            dask.config.get("distributed.worker.profile.enabled"),
            os.environ.get("PYTHONPATH", ""),
            os.environ.get("MALLOC_TRIM_THRESHOLD_"),  # the nanny's default is 65536
        )

    env = stack_state.env
    assert [s.name for s in stack_state.services] == list(START_ORDER)
    assert [problem for _, problem in stack.stack_status(stack_state.dir)] == [None] * 6
    for name in ("moto", "mlflow", "prefect-server"):
        assert services.http_ok(stack_state.service(name).extra["health_url"])

    with distributed.Client(env["DDPFLOW_DASK_ADDRESS"], timeout=30) as client:
        assert len(client.nthreads()) == NUM_WORKERS
        # The workers run with the settings DDP ranks need.
        config = client.run(dask_settings)
        expected = (False, False, str(services.REPO), None)
        assert all(v == expected for v in config.values()), config

    worker = stack_state.service("prefect-worker")
    url = f"{env['PREFECT_API_URL']}/work_pools/{WORK_POOL}/workers/filter"
    names = [w["name"] for w in httpx.post(url, json={}, trust_env=False).json()]
    assert worker.extra["worker_name"] in names

    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL_S3"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    assert BUCKET in [b["Name"] for b in s3.list_buckets()["Buckets"]]

    # MLflow proxies artifacts into the moto bucket: the client itself holds no S3 settings.
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run = client.create_run(client.create_experiment("stack-check"))
    client.log_text(run.info.run_id, "hello", "hello.txt")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="mlflow/")["Contents"]]
    assert any(k.endswith(f"{run.info.run_id}/artifacts/hello.txt") for k in keys), keys

    env_sh = stack_state.env_path.read_text()
    assert f"export PREFECT_API_URL={env['PREFECT_API_URL']}" in env_sh
    assert "export DDPFLOW_ARTIFACT_ROOT=s3://ddpflow/artifacts" in env_sh
    saved = json.loads(stack_state.state_path.read_text())
    assert [s["pgid"] for s in saved["services"]] == [s.pid for s in stack_state.services]


@pytest.mark.timeout(120)
def test_stop_leaves_no_process_or_port_behind(stack_state: StackState):
    procs = stack_processes(stack_state)
    # Leaders, mlflow's uvicorn, 2 nannies' worker processes at least.
    assert len(procs) >= len(stack_state.services) + 1 + NUM_WORKERS
    sockets = listening(set(procs))
    assert sockets and all(ip == "127.0.0.1" for _, ip, _ in sockets), sockets
    ports = {port for _, _, port in sockets} | set(stack_state.ports.values())

    assert stack.stop_stack(stack_state.dir) is True

    assert [pid for pid, created in procs.items() if pid_alive(pid, created)] == []
    assert [port for port in ports if port_listened(port)] == []
    assert not stack_state.state_path.exists()
    assert stack.stop_stack(stack_state.dir) is False


@pytest.mark.timeout(180)
def test_failed_start_stops_what_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    seen: dict[int, float] = {}

    def broken_dask(*args: object, **kwargs: object) -> None:
        state = StackState.load(tmp_path)
        assert state is not None and len(state.services) == 3  # moto, mlflow, prefect-server
        seen.update(stack_processes(state))
        raise ServiceError("dask-scheduler: injected failure")

    monkeypatch.setattr(stack.services, "start_dask", broken_dask)
    with pytest.raises(ServiceError, match="injected failure"):
        stack.start_stack(tmp_path, num_workers=1, free_ports=True)
    assert len(seen) >= 3
    assert [pid for pid, created in seen.items() if pid_alive(pid, created)] == []
    assert not (tmp_path / "state.json").exists()


def test_busy_default_port_is_named(monkeypatch: pytest.MonkeyPatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr(stack, "DEFAULT_PORTS", {**stack.DEFAULT_PORTS, "mlflow": port})
        with pytest.raises(StackError, match=rf"{port} \(mlflow\).*--free-ports"):
            stack.choose_ports(free_ports=False)


def test_health_wait_names_service_url_and_log(tmp_path: Path):
    code = "import sys; print('cannot start: boom'); sys.exit(3)"
    service = spawn("broken", [sys.executable, "-c", code], dict(os.environ), tmp_path)
    service.url = f"http://127.0.0.1:{services.free_port()}/health"
    with pytest.raises(ServiceError) as err:
        wait_http(service.url, 30, service)
    message = str(err.value)
    assert "broken" in message and service.url in message
    assert str(tmp_path / "broken.log") in message and "cannot start: boom" in message
