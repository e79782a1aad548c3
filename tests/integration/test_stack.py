"""The local stack starts, reports healthy, refuses clients without its credentials, and stops
leaving no process behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sqlite3
import ssl
import stat
import sys
from pathlib import Path
from typing import Any

import botocore.exceptions
import distributed
import httpx
import psutil
import pytest
from botocore.parsers import ResponseParserError
from distributed.security import Security

from ddpflow.integrations.prefect import db_template as prefect_db_template
from infra import services, stack
from infra.certs import make_certs, security_from_env
from infra.procs import ServiceError, pid_alive, process_start, spawn, wait_http
from infra.seaweedfs.server import grpc_socket_paths
from infra.state import BUCKET, START_ORDER, WORK_POOL, StackError, StackState
from tests.helpers.as_stranger import STRANGER_UID, require_stranger, run_as_stranger
from tests.helpers.s3_servers import s3_client

pytestmark = pytest.mark.integration

NUM_WORKERS = 2  # the session's local_stack (tests/integration/conftest.py)
PROBE = Path(__file__).parents[1] / "helpers" / "stranger_probe.py"


def stack_processes(state: StackState) -> dict[int, float]:
    """pid -> start time of every process in the stack's groups and process trees."""
    found: dict[int, float] = {}
    groups = {service.pid for service in state.services}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups:
                found[proc.pid] = process_start(proc)
        except (OSError, psutil.Error):
            continue
    for service in state.services:
        try:
            leader = psutil.Process(service.pid)
            for proc in [leader, *leader.children(recursive=True)]:
                found[proc.pid] = process_start(proc)
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


def held_by_older_processes(ports: set[int], older: dict[int, float]) -> list[tuple[int, int]]:
    """(port, pid) of each of `ports` listened on by one of the `older` processes (pid: start
    time, taken before the stack stopped). A process started since then is not the stack's:
    the other test processes start services on free ports from the same range, and one took
    a port the stop had just freed (31873, in a full run)."""
    held = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.laddr.port not in ports or not conn.pid:
            continue
        if conn.pid in older and pid_alive(conn.pid, older[conn.pid]):
            held.append((conn.laddr.port, conn.pid))
    return held


@pytest.fixture(scope="module")
def stack_state(local_stack: StackState) -> StackState:
    """The session's stack (the deployments' tests used it before these run)."""
    return local_stack


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
    for name in ("seaweedfs", "mlflow", "prefect-server"):
        assert services.http_ok(stack_state.service(name).extra["health_url"])
    # The Prefect UI calls the API on the port the server took, not Prefect's default :4200.
    ui_settings = env["PREFECT_API_URL"].removesuffix("/api") + "/ui-settings"
    assert httpx.get(ui_settings, trust_env=False).json()["api_url"] == env["PREFECT_API_URL"]

    security = security_from_env(env)
    with distributed.Client(env["DDPFLOW_DASK_ADDRESS"], timeout=30, security=security) as client:
        assert len(client.nthreads()) == NUM_WORKERS
        # The workers run with the settings DDP ranks need.
        config = client.run(dask_settings)
        expected = (False, False, str(services.REPO), None)
        assert all(v == expected for v in config.values()), config

    worker = stack_state.service("prefect-worker")
    url = f"{env['PREFECT_API_URL']}/work_pools/{WORK_POOL}/workers/filter"
    login = tuple(env["PREFECT_API_AUTH_STRING"].split(":", 1))
    names = [w["name"] for w in httpx.post(url, json={}, trust_env=False, auth=login).json()]
    assert worker.extra["worker_name"] in names

    s3 = _s3(env, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    assert BUCKET in [b["Name"] for b in s3.list_buckets()["Buckets"]]

    # MLflow proxies artifacts into the SeaweedFS bucket: the client itself holds no S3 settings.
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, env[key])
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


def _dask_refuses(address: str, security: Security | None) -> str:
    """Why a Dask client with these settings cannot talk to the scheduler (fails if it can)."""
    try:
        with distributed.Client(address, timeout=5, security=security) as client:
            client.nthreads()
    except (OSError, TimeoutError) as error:  # CommClosedError is an OSError
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"a client without the stack's certificate reached {address}")


def _tls_handshake_refused(port: int, ca: Path) -> bool:
    """A TLS client that trusts the stack's CA but shows no certificate of its own."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            context.wrap_socket(raw) as tls,
        ):
            tls.sendall(b"\0" * 8)
            return tls.recv(1) == b""  # TLS 1.3: the refusal arrives with the first read
    except (ssl.SSLError, OSError):
        return True


# docs/s3-and-servers.md: the stack's Prefect and MLflow servers start on copies of the
# migrated databases `make venv` built, as a flow's embedded API and store do. Prefect's copy
# keeps the template's block types, ids and all (a server that migrated a new database makes
# its own); MLflow logs that it creates its tables only where it migrates.
def test_the_servers_started_on_the_installed_database_templates(stack_state: StackState):
    mlflow_log = stack_state.service("mlflow").log_path.read_text()
    assert "Creating initial MLflow database tables" not in mlflow_log, mlflow_log[-3000:]
    template = prefect_db_template.template_path()
    assert template is not None and template.is_file(), f"make venv builds {template}"

    def block_type_ids(database: Path) -> set[str]:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            return {row[0] for row in db.execute("SELECT id FROM block_type")}

    made = block_type_ids(template)
    assert made, "the template holds Prefect's block types"
    assert made <= block_type_ids(stack_state.dir / "prefect" / "prefect.db")


@pytest.mark.timeout(120)
def test_every_server_refuses_clients_without_credentials(
    stack_state: StackState, tmp_path: Path
) -> None:
    env = stack_state.env
    prefect = f"{env['PREFECT_API_URL']}/flows/filter"
    assert httpx.post(prefect, json={}, trust_env=False).status_code == 401
    wrong = ("ddpflow", "guess")
    assert httpx.post(prefect, json={}, trust_env=False, auth=wrong).status_code == 401
    login = tuple(env["PREFECT_API_AUTH_STRING"].split(":", 1))
    assert httpx.post(prefect, json={}, trust_env=False, auth=login).status_code == 200

    mlflow = f"{env['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search?max_results=1"
    assert httpx.get(mlflow, trust_env=False).status_code == 401
    assert httpx.get(mlflow, trust_env=False, auth=wrong).status_code == 401
    user = (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"])
    assert httpx.get(mlflow, trust_env=False, auth=user).status_code == 200

    address = env["DDPFLOW_DASK_ADDRESS"]
    assert address.startswith("tls://127.0.0.1:")
    port = int(address.rsplit(":", 1)[1])
    stranger = make_certs(tmp_path / "stranger")  # a valid certificate from another CA
    ca = Path(env["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"])
    foreign = Security(
        require_encryption=True,
        tls_ca_file=str(ca),
        tls_client_cert=str(stranger.cert),
        tls_client_key=str(stranger.key),
    )
    assert _dask_refuses(address, foreign)
    assert _dask_refuses(address.replace("tls://", "tcp://"), Security())
    assert _tls_handshake_refused(port, ca)

    # S3: SeaweedFS knows two keys, the administrator's (not in env) and the stack user's,
    # which reaches the stack's bucket only.
    endpoint = env["AWS_ENDPOINT_URL_S3"]
    object_url = f"{endpoint}/{BUCKET}/artifacts/unsigned.json"
    own = _s3(env, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])

    def stored() -> list[str]:  # the session's stack also holds the deployments' runs
        listed = own.list_objects_v2(Bucket=BUCKET, Prefix="artifacts/").get("Contents", [])
        return sorted(o["Key"] for o in listed)

    before = stored()
    assert "artifacts/unsigned.json" not in before and "artifacts/x" not in before
    assert httpx.put(object_url, content=b"{}", trust_env=False).status_code == 403
    for key_id, secret, refusal in [
        ("testing", "testing", "InvalidAccessKeyId"),  # the keys moto took from anyone
        (env["AWS_ACCESS_KEY_ID"], "guess", "SignatureDoesNotMatch"),
    ]:
        with pytest.raises(botocore.exceptions.ClientError, match=refusal):
            _s3(env, key_id, secret).put_object(Bucket=BUCKET, Key="artifacts/x", Body=b"x")
    assert stored() == before, "a refused request wrote an object"
    own.put_object(Bucket=BUCKET, Key="artifacts/x", Body=b"x")  # the key works on its bucket
    with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):
        own.create_bucket(Bucket="another-bucket")
    iam = _client("iam", env, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    # Nor can it make a key with more rights: the S3 port serves no IAM API (405, no body).
    with pytest.raises((botocore.exceptions.ClientError, ResponseParserError)):
        iam.create_user(UserName="intruder")
    assert [b["Name"] for b in own.list_buckets()["Buckets"]] == [BUCKET]


@pytest.mark.timeout(120)
def test_another_local_user_can_neither_read_nor_change_what_s3_stores(
    stack_state: StackState,
) -> None:
    """Run as `nobody`: every route of every SeaweedFS port refuses a request without the
    stack's key or certificate, and what the bucket holds is the same afterwards."""
    require_stranger()
    env = stack_state.env
    own = _s3(env, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    own.put_object(Bucket=BUCKET, Key="artifacts/latest.json", Body=b'{"step": 7}')
    admin = _stack_admin(stack_state)
    before = _stored(own, admin)

    targets = _stranger_targets(stack_state)
    report = json.loads(run_as_stranger(PROBE.read_text(), json.dumps(targets)))
    assert report["uid"] == STRANGER_UID
    assert len(report["attempts"]) >= 30, report["attempts"]
    answered = [a for a in report["attempts"] if not _refused(a["answer"])]
    assert answered == [], "routes that served another user:\n" + json.dumps(answered, indent=1)
    assert _stored(own, admin) == before, "a refused request changed what S3 stores"


def _refused(answer: str) -> bool:
    """No route ran: the connection, TLS handshake or folder was refused, the S3 gateway
    answered 401/403 (or 405 with no body: no route for that method and path), or an inner
    HTTPS port answered plain HTTP with Go's 400."""
    if answer.startswith("refused"):
        return True
    if answer.startswith(("answered 401", "answered 403")) or answer == "answered 405: ":
        return True
    return answer.startswith("answered 400") and "HTTPS server" in answer


def _stack_admin(state: StackState) -> Any:
    """An S3 client with the stack's administrator key (kept in its SeaweedFS identities)."""
    identities = json.loads((state.secrets_dir / "seaweedfs" / "identities.json").read_text())
    (admin,) = [i for i in identities["identities"] if "Admin" in i["actions"]]
    key = admin["credentials"][0]
    return _s3(state.env, key["accessKey"], key["secretKey"])


def _stored(own: Any, admin: Any) -> dict[str, str]:
    """Every bucket, and every object of the stack's bucket with a digest of its bytes."""
    found = {f"bucket {b['Name']}": "" for b in admin.list_buckets()["Buckets"]}
    pages = own.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    for obj in (o for page in pages for o in page.get("Contents", [])):
        data = own.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
        found[obj["Key"]] = hashlib.sha256(data).hexdigest()
    return found


def _stranger_targets(state: StackState) -> dict[str, Any]:
    """What the stranger tries: anonymous and wrongly signed S3 requests, every inner HTTP
    port's admin routes (plain and TLS), the gRPC ports, the unix sockets, the folders."""
    env = state.env
    s3 = env["AWS_ENDPOINT_URL_S3"]
    latest = f"{s3}/{BUCKET}/artifacts/latest.json"
    forged = '{"step": 999}'
    requests = [
        ("GET", f"{s3}/"), ("GET", f"{s3}/{BUCKET}?list-type=2"), ("GET", latest),
        ("PUT", latest), ("DELETE", latest), ("PUT", f"{s3}/intruder-bucket"),
        ("DELETE", f"{s3}/{BUCKET}"), ("POST", f"{s3}/?Action=CreateUser&UserName=intruder"),
    ]  # fmt: skip
    http = [{"what": "S3 anonymous", "method": m, "url": u, "body": forged} for m, u in requests]
    for key_id, secret in [(env["AWS_ACCESS_KEY_ID"], "guess"), ("DDPFNOSUCHKEY", "guess")]:
        for method, url in requests:
            http.append(_signed(method, url, forged, key_id, secret, env["AWS_DEFAULT_REGION"]))
    ports = state.service("seaweedfs").extra["ports"]
    inner = {
        "master": ["/dir/assign", "/col/delete?collection=ddpflow", "/vol/grow?count=1",
                   "/cluster/status", "/dir/status"],
        "volume": ["/status", "/1,01637037d6"],
        "filer": [f"/buckets/{BUCKET}/artifacts/latest.json", f"/buckets/{BUCKET}/?recursive=true"],
    }  # fmt: skip
    for name, paths in inner.items():
        for scheme in ("http", "https"):
            for path in paths:
                for method in ("GET", "POST", "DELETE"):
                    url = f"{scheme}://127.0.0.1:{ports[name]}{path}"
                    http.append({"what": f"SeaweedFS {name}", "method": method, "url": url})
    config = state.secrets_dir / "seaweedfs"
    sockets = [*grpc_socket_paths(ports), config / "s3.sock", config / "filer.sock"]
    return {
        "http": http,
        "tls_ports": [port for key, port in ports.items() if key.endswith("_grpc")],
        "sockets": [str(path) for path in sockets if path.exists()],
        "folders": [str(state.dir / "s3"), str(config)],
    }


def _signed(method: str, url: str, body: str, key_id: str, secret: str, region: str) -> dict:
    """A request signed as botocore signs S3 requests, with a key the stranger guessed."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    data = body.encode()
    request = AWSRequest(method=method, url=url, data=data)
    request.headers["x-amz-content-sha256"] = hashlib.sha256(data).hexdigest()
    S3SigV4Auth(Credentials(key_id, secret), "s3", region).add_auth(request)
    headers = {k: v for k, v in request.headers.items()}
    return {"what": f"S3 signed by {key_id}", "method": method, "url": url, "headers": headers,
            "body": body}  # fmt: skip


def _s3(env: dict[str, str], key_id: str, secret: str) -> Any:
    return _client("s3", env, key_id, secret)


def _client(service: str, env: dict[str, str], key_id: str, secret: str) -> Any:
    """A boto3 client of the stack's S3 endpoint (boto3 types its clients at run time)."""
    return s3_client(env["AWS_ENDPOINT_URL_S3"], key_id, secret, service)


def test_credential_files_are_private(stack_state: StackState) -> None:
    secrets = stack_state.secrets_dir
    files = [stack_state.state_path, stack_state.env_path, *secrets.rglob("*")]
    files = [f for f in files if f.is_file() and f.suffix != ".db"]
    assert len(files) >= 6, files  # state, env, MLflow auth config, CA, certificate, key
    modes = {str(f): oct(stat.S_IMODE(f.stat().st_mode)) for f in files}
    assert set(modes.values()) == {"0o600"}, modes
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700  # also guards MLflow's user DB
    printed = stack.summary(stack_state)
    for key in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY"):
        assert stack_state.env[key] not in printed, f"{key} printed by `up`"
        assert stack_state.env[key] in stack_state.env_path.read_text()


@pytest.mark.timeout(120)
@pytest.mark.stops_local_stack
def test_stop_leaves_no_process_or_port_behind(stack_state: StackState):
    procs = stack_processes(stack_state)
    # Leaders, mlflow's uvicorn, 2 nannies' worker processes at least.
    assert len(procs) >= len(stack_state.services) + 1 + NUM_WORKERS
    sockets = listening(set(procs))
    assert sockets and all(ip == "127.0.0.1" for _, ip, _ in sockets), sockets
    ports = {port for _, _, port in sockets} | set(stack_state.ports.values())

    older = {}  # every process now, to tell the stack's from those other tests start later
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # ended since it was listed
            older[process.pid] = process_start(process)
    assert stack.stop_stack(stack_state.dir) is True

    assert [pid for pid, created in procs.items() if pid_alive(pid, created)] == []
    assert held_by_older_processes(ports, older) == []
    assert not stack_state.state_path.exists()
    assert not stack_state.secrets_dir.exists(), "credentials of a stopped stack are removed"
    assert stack.stop_stack(stack_state.dir) is False


@pytest.mark.timeout(180)
def test_failed_start_stops_what_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    seen: dict[int, float] = {}

    def broken_dask(*args: object, **kwargs: object) -> None:
        state = StackState.load(tmp_path)
        assert state is not None and len(state.services) == 3  # seaweedfs, mlflow, prefect
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
