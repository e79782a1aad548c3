"""The compose recipe (infra/docker/compose.yaml) run for real: the project's image built
and run, the stack up with TLS and auth on and its own S3 server (SeaweedFS), a training
started with `prefect deployment run` on the stack's own Prefect worker, its MLflow run and
the checkpoints in the S3 bucket read back, a client without credentials refused by every
service, and the workers' S3 key refused outside its bucket.

What this machine cannot run is swapped by tests/compose_stack/compose.test.yaml (nginx's
image, GPUs), each with the reason; everything else is the recipe's, credentials made by
`python -m infra.compose_secrets` and certificates by `python -m infra.certs`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore
import botocore.config
import botocore.exceptions
import pytest

from infra.compose_check import read_env_file
from tests.compose_stack.engine import (
    PROJECT,
    REPO,
    build_images,
    ensure_engine,
    remove_project,
    run,
)

pytestmark = [pytest.mark.integration, pytest.mark.docker]

PROJECT_NAME = "ddpflowtest"
RECIPE = REPO / "infra" / "docker"
# The recipe's services this machine runs (no GPU workers; compose.test.yaml adds CPU ones).
SERVICES = [
    "check-secrets",
    "s3",
    "prefect-server",
    "mlflow",
    "tls-proxy",
    "dask-scheduler",
    "dask-cpu-worker",
    "dask-rank-workers",
    "prefect-worker",
]
TINY = {"epochs": 1, "hidden_size": 16, "num_layers": 1, "batch_size": 4096, "num_names": 2}


# docker-compose on the recipe with the test's swaps, as project PROJECT_NAME.
COMPOSE = ["docker-compose", "-p", PROJECT_NAME, "-f", "compose.yaml", "-f", "compose.test.yaml"]


def compose(stack: Path, *args: str, timeout_s: float = 900) -> str:
    result = run(*COMPOSE, *args, cwd=stack, timeout_s=timeout_s)
    return result.stdout + result.stderr


def in_worker(stack: Path, *argv: str, timeout_s: float = 900) -> str:
    """A command in the stack's Prefect worker container (working directory /opt/ddpflow,
    the stack's settings and credentials)."""
    return compose(stack, "exec", "-T", "prefect-worker", *argv, timeout_s=timeout_s)


def _wait_for(what: str, check, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")
        time.sleep(2)


def s3_client(key_id: str | None, secret: str | None, service: str = "s3", **kwargs):
    """A client of the stack's S3 on this host with the given key (None: unsigned requests)."""
    if key_id is None:
        kwargs["config"] = botocore.config.Config(signature_version=botocore.UNSIGNED)
    return boto3.client(
        service,
        endpoint_url=kwargs.pop("endpoint_url", "http://127.0.0.1:9000"),
        region_name="us-east-1",
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        **kwargs,
    )


def _refused(call, *args, **kwargs) -> str:
    """The S3 error code (or HTTP status) a request gets; fails the test if it succeeds."""
    try:
        call(*args, **kwargs)
    except botocore.exceptions.ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        return code or str(error.response["ResponseMetadata"]["HTTPStatusCode"])
    raise AssertionError(f"{call.__name__} was allowed")


def _status(url: str, context: ssl.SSLContext | None = None, post: bool = False) -> int:
    """The HTTP status of a request without credentials."""
    request = urllib.request.Request(url, data=b"{}" if post else None)
    if post:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Iterator[str]:
    """The project's image (tag), built with the base images it needs; the engine this
    fixture started stops after the module."""
    engine = ensure_engine()
    try:
        build_images(tmp_path_factory.mktemp("docker-build"))
        yield PROJECT
    finally:
        if engine is not None:
            engine.terminate()
            engine.wait(timeout=60)


def in_image(image: str, *argv: str) -> str:
    """A command in a new container of `image` with no network: what the image holds alone."""
    result = run("docker", "run", "--rm", "--network", "none", image, *argv, timeout_s=300)
    return result.stdout + result.stderr


# infra/docker/Dockerfile: every process of the image imports the application code (flows,
# tasks) from the checkout at /opt/ddpflow on PYTHONPATH, the wheel ships only the library,
# and the image's default command is the flow's help, which needs no server.
def test_the_image_runs_the_flows_and_tasks_of_its_checkout(images):
    where = in_image(
        images, "python", "-c",
        "import ddpflow, flows.train_charlm, tasks.charlm, torch; "
        "print(tasks.charlm.__file__, flows.train_charlm.__file__, ddpflow.__file__)",
    )  # fmt: skip
    tasks_file, flows_file, library_file = where.split()
    assert tasks_file == "/opt/ddpflow/tasks/charlm.py", where
    assert flows_file == "/opt/ddpflow/flows/train_charlm.py", where
    assert library_file == "/opt/ddpflow/ddpflow/__init__.py", where  # the editable install
    help_text = in_image(images)  # CMD: python -m flows.train_charlm --help
    assert "--epochs" in help_text and "usage" in help_text.lower(), help_text[-2000:]


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory) -> Iterator[dict]:
    """The stack up on the built images, its folder and credentials; down on exit."""
    folder = tmp_path_factory.mktemp("stack")
    for name in ("compose.yaml", "mlflow-auth.ini", "nginx-tls.conf"):
        shutil.copy(RECIPE / name, folder / name)
    shutil.copy(Path(__file__).with_name("compose.test.yaml"), folder / "compose.test.yaml")
    python = [sys.executable, "-m"]
    run(*python, "infra.compose_secrets", str(folder), cwd=REPO)
    run(*python, "infra.certs", str(folder / "tls"), cwd=REPO)
    run(
        *python,
        "infra.certs",
        str(folder / "https"),
        "--host",
        "127.0.0.1",
        "--host",
        "localhost",
        cwd=REPO,
    )
    env = {**read_env_file(folder / "ddpflow.env"), **read_env_file(folder / "s3.env")}
    try:
        # A stack left by an interrupted run (same project name) goes first, volumes too:
        # MLflow's user DB would keep that run's admin password.
        remove_project(PROJECT_NAME)
        compose(folder, "up", "-d", *SERVICES)
        _wait_for("Prefect's API", lambda: _status("http://127.0.0.1:4200/api/health") == 200)
        _wait_for("MLflow", lambda: _status("http://127.0.0.1:5000/health") == 200)
        _wait_for(
            "the Prefect worker",
            lambda: "started" in compose(folder, "logs", "--no-color", "prefect-worker").lower(),
        )
        yield {"folder": folder, "env": env}
    finally:
        # Unchecked: the stack comes down whatever state it is in.
        logs = subprocess.run(
            [*COMPOSE, "logs", "--no-color", "--tail", "60"],
            cwd=folder, capture_output=True, text=True, check=False,
        )  # fmt: skip
        (folder / "stack.log").write_text(logs.stdout + logs.stderr)
        subprocess.run(
            [*COMPOSE, "down", "-v", "--timeout", "10"],
            cwd=folder, capture_output=True, check=False, timeout=300,
        )  # fmt: skip


@pytest.fixture(scope="module")
def trained(stack) -> dict:
    """charlm-ddp deployed from the worker's checkout and run with `prefect deployment run`."""
    folder = stack["folder"]
    in_worker(folder, "prefect", "--no-prompt", "deploy", "--prefect-file",
              "deployments/prefect.yaml", "--name", "charlm-ddp")  # fmt: skip
    flags = [f"--param=training={json.dumps(TINY)}"]
    output = in_worker(
        folder, "prefect", "deployment", "run", "train-charlm/charlm-ddp", *flags,
        "--watch", "--watch-timeout", "600", timeout_s=700,
    )  # fmt: skip
    return {**stack, "output": output}


def test_a_deployment_run_trains_on_the_stack_and_registers(trained, monkeypatch):
    assert "Completed" in trained["output"], trained["output"][-4000:]
    env = trained["env"]
    from mlflow import MlflowClient

    # MLflow's client reads its basic-auth credentials from the environment.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", env["MLFLOW_TRACKING_USERNAME"])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", env["MLFLOW_TRACKING_PASSWORD"])
    client = MlflowClient("http://127.0.0.1:5000")
    experiment = client.get_experiment_by_name("ddpflow-charlm")
    (run_,) = client.search_runs([experiment.experiment_id])
    assert run_.info.status == "FINISHED"
    assert run_.data.metrics["val_loss"] > 0
    versions = client.search_model_versions("name='ddpflow-charlm'")
    assert len(versions) == 1 and versions[0].run_id == run_.info.run_id
    s3 = s3_client(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ddpflow").get("Contents", [])]
    assert any(re.search(r"^artifacts/runs/.+/checkpoints/epoch-0001\.pt$", k) for k in keys), keys
    assert any(k.startswith("mlflow/") for k in keys), "MLflow's artifacts are in the bucket"


def test_every_service_refuses_a_client_without_credentials(stack):
    env = stack["env"]
    assert _status("http://127.0.0.1:4200/api/flows/filter", post=True) == 401
    assert _status("http://127.0.0.1:5000/api/2.0/mlflow/experiments/search?max_results=1") == 401
    # S3: no signature, an unknown key, a known key with a wrong secret.
    for key_id, secret in (
        (None, None),
        ("stranger", "not-a-key"),
        (env["AWS_ACCESS_KEY_ID"], "not-the-secret-of-this-key"),
    ):
        client = s3_client(key_id, secret)
        assert _refused(client.list_objects_v2, Bucket="ddpflow") in {
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
        }, key_id
        assert _refused(client.put_object, Bucket="ddpflow", Key="x", Body=b"x")
    # Dask: mutual TLS; a client without the stack's certificate does not get in.
    probe = (
        "import distributed, sys\n"
        "try:\n"
        "    distributed.Client('tls://127.0.0.1:8786', timeout=10)\n"
        "except Exception as error:\n"
        "    print('refused', type(error).__name__); sys.exit(0)\n"
        "print('connected'); sys.exit(1)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DASK_")},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # Through the TLS proxy, with the stack's CA: reachable, and still behind auth.
    ca = str(stack["folder"] / "https" / "ca.pem")
    context = ssl.create_default_context(cafile=ca)
    assert _status("https://127.0.0.1:5443/health", context=context) == 200
    assert _status("https://127.0.0.1:5443/api/2.0/mlflow/experiments/search?max_results=1",
                   context=context) == 401  # fmt: skip
    # S3 through the proxy: the workers' key signs for the proxy's address (nginx passes the
    # Host header on), a request without a signature is refused.
    proxied = {"endpoint_url": "https://127.0.0.1:9443", "verify": ca}
    worker = s3_client(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], **proxied)
    worker.put_object(Bucket="ddpflow", Key="probes/through-the-proxy", Body=b"tls")
    assert worker.get_object(Bucket="ddpflow", Key="probes/through-the-proxy")["Body"].read()
    assert _refused(s3_client(None, None, **proxied).list_objects_v2, Bucket="ddpflow")


# The S3 server's two identities (infra/seaweedfs/serve.py): the administrator (s3.env) makes
# buckets; the workers' key (ddpflow.env) reads and writes the bucket ddpflow and nothing else.
def test_the_workers_s3_key_is_refused_outside_its_bucket(stack):
    env = stack["env"]
    admin = s3_client(env["S3_ADMIN_ACCESS_KEY_ID"], env["S3_ADMIN_SECRET_ACCESS_KEY"])
    admin.create_bucket(Bucket="admins-own")
    admin.put_object(Bucket="admins-own", Key="private", Body=b"the administrator's")
    worker = s3_client(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    worker.put_object(Bucket="ddpflow", Key="probes/worker", Body=b"mine")
    assert worker.get_object(Bucket="ddpflow", Key="probes/worker")["Body"].read() == b"mine"
    assert _refused(worker.create_bucket, Bucket="workers-own") == "AccessDenied"
    assert _refused(worker.get_object, Bucket="admins-own", Key="private") == "AccessDenied"
    assert _refused(worker.list_objects_v2, Bucket="admins-own") == "AccessDenied"
    assert _refused(worker.put_object, Bucket="admins-own", Key="x", Body=b"x") == "AccessDenied"
    assert _refused(worker.delete_object, Bucket="admins-own", Key="private") == "AccessDenied"
    assert _refused(worker.delete_bucket, Bucket="admins-own") == "AccessDenied"
    listed = [b["Name"] for b in worker.list_buckets()["Buckets"]]
    assert listed == ["ddpflow"], listed  # the administrator's bucket is not even named
    assert admin.get_object(Bucket="admins-own", Key="private")["Body"].read()
    # IAM on the S3 port (SeaweedFS serves it unless told not to): the workers' key cannot
    # list users or give itself another key.
    key = (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    for action in ("ListUsers", "CreateAccessKey&UserName=ddpflow-worker", "CreateUser&UserName=x"):
        status, body = _signed_iam_request(*key, action)
        assert status in (403, 405), (action, status, body[:300])
        assert b"AccessKeyId" not in body and b"<User>" not in body


def _signed_iam_request(key_id: str, secret: str, action: str) -> tuple[int, bytes]:
    """An IAM API request (POST / with Action=...) signed with this key, as an AWS IAM client
    sends it: its status and body, whatever they are (boto3's IAM client cannot parse the
    empty body of a 405)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest(
        method="POST",
        url="http://127.0.0.1:9000/",
        data=f"Action={action}&Version=2010-05-08".encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"},
    )
    SigV4Auth(Credentials(key_id, secret), "iam", "us-east-1").add_auth(request)
    prepared = request.prepare()
    sent = urllib.request.Request(
        prepared.url, data=prepared.body, headers=dict(prepared.headers), method="POST"
    )
    try:
        with urllib.request.urlopen(sent, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _s3_container(folder: Path, code: str) -> str:
    return compose(folder, "exec", "-T", "s3", "python", "-c", code)


# What the S3 container exposes: its inner services (master, volume, filer) on 127.0.0.1 only,
# so another container reaches the S3 gateway and, beside it, a gRPC port that asks for a
# certificate of the server's own CA; the keys in no process's argv or weed's environment.
LISTENERS = """
import json
listening = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":
            address, port = local.rsplit(":", 1)
            listening.add((address, int(port, 16)))
print(json.dumps(sorted(listening)))
"""
PROCESSES = """
import json, os
found = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
    except OSError:
        continue
    pairs = [e.decode(errors="replace").partition("=") for e in environ if e]
    found[pid] = {"argv": [a.decode(errors="replace") for a in argv if a],
                  "env": [name for name, _, _ in pairs],
                  "env_values": [value for _, _, value in pairs]}
print(json.dumps(found))
"""
ANY = {"00000000", "00000000000000000000000000000000"}


def _loopback(address: str) -> bool:
    """/proc/net/tcp's hex address is in 127.0.0.0/8 (Docker's DNS listens on 127.0.0.11) or ::1."""
    return address.endswith("7F") if len(address) == 8 else address == "0" * 24 + "01000000"


def test_the_s3_container_exposes_only_the_gateway_and_no_key(stack):
    folder, env = stack["folder"], stack["env"]
    listening = json.loads(_s3_container(folder, LISTENERS).strip().splitlines()[-1])
    outside = {port for address, port in listening if not _loopback(address)}
    assert all(_loopback(address) or address in ANY for address, _ in listening), listening
    assert 9000 in outside and len(outside) == 2, listening  # the gateway and its gRPC
    (grpc,) = outside - {9000}
    assert len(listening) > 6, "master, volume and filer (HTTP and gRPC) listen on loopback"
    probe = (
        "import socket, ssl, sys\n"
        "context = ssl.create_default_context()\n"
        "context.check_hostname = False\n"
        "context.verify_mode = ssl.CERT_NONE\n"
        "context.set_alpn_protocols(['h2'])\n"
        f"sock = context.wrap_socket(socket.create_connection(('s3', {grpc}), 10))\n"
        "try:\n"
        "    sock.sendall(b'PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n')\n"
        "    sock.recv(100)\n"
        "except ssl.SSLError as error:\n"
        "    print('refused', error.reason); sys.exit(0)\n"
        "print('answered'); sys.exit(1)\n"
    )
    refused = in_worker(folder, "python", "-c", probe)
    assert "CERTIFICATE_REQUIRED" in refused, refused
    processes = json.loads(_s3_container(folder, PROCESSES).strip().splitlines()[-1])
    weed = [p for p in processes.values() if p["argv"] and p["argv"][0].endswith("/weed")]
    assert len(weed) == 1, processes
    secrets = [env[n] for n in ("S3_ADMIN_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY")]
    for process in processes.values():
        assert not any(s in arg for s in secrets for arg in process["argv"]), process["argv"]
    assert not any(s in v for s in secrets for v in weed[0]["env_values"])
    assert not any(n.startswith(("AWS_", "S3_ADMIN_")) for n in weed[0]["env"]), weed[0]["env"]
    # No ddpflow container holds the administrator's key.
    for service in SERVICES:
        if service in ("s3", "check-secrets"):
            continue
        ids = compose(folder, "ps", "-q", service).split()
        for container in ids:
            names = run("docker", "inspect", "--format", "{{json .Config.Env}}", container).stdout
            assert "S3_ADMIN_" not in names, service


# Last: stops and restarts the S3 server. SIGTERM stops it within seconds (serve passes it on
# and kills weed, which ignores it for minutes, after 3 s); its data lives in the volume.
def test_the_s3_server_stops_on_sigterm_and_keeps_its_data(stack):
    folder, env = stack["folder"], stack["env"]
    worker = s3_client(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    worker.put_object(Bucket="ddpflow", Key="probes/kept", Body=b"across a restart")
    (container,) = compose(folder, "ps", "-q", "s3").split()
    started = time.monotonic()
    compose(folder, "stop", "--timeout", "30", "s3")
    stopped_in = time.monotonic() - started
    state = json.loads(run("docker", "inspect", "--format", "{{json .State}}", container).stdout)
    assert state["ExitCode"] == 0 and not state["OOMKilled"], state
    assert stopped_in < 15, f"the S3 container took {stopped_in:.1f} s to stop"
    compose(folder, "start", "s3")

    def back() -> bool:
        inspect = run("docker", "inspect", "--format", "{{.State.Health.Status}}", container)
        body = worker.get_object(Bucket="ddpflow", Key="probes/kept")["Body"].read()
        return inspect.stdout.strip() == "healthy" and body == b"across a restart"

    _wait_for("the S3 server, healthy and with its data, after a restart", back, timeout_s=180)
