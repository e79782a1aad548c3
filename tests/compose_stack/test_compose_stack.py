"""The compose recipe (infra/docker/compose.yaml) run for real: the project's image built
and run, the stack up with TLS and auth on, a training started with `prefect deployment run` on the
stack's own Prefect worker, its MLflow run and S3 objects read back, and a client without
credentials refused by every service.

What this machine cannot run is swapped by tests/compose_stack/compose.test.yaml (MinIO's and
nginx's images, GPUs), each with the reason; everything else is the recipe's, credentials
made by `python -m infra.compose_secrets` and certificates by `python -m infra.certs`.
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
    "minio",
    "minio-init",
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


def s3_client(key_id: str, secret: str):
    """A client of the stack's S3 on this host with the given key."""
    return boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:9000",
        region_name="us-east-1",
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
    )


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
    (folder / "standin").mkdir()
    shutil.copy(Path(__file__).with_name("s3_standin.py"), folder / "standin" / "s3_standin.py")
    shutil.copy(RECIPE / "minio-ddpflow-policy.json", folder / "standin" / "policy.json")
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
    env = {**read_env_file(folder / "ddpflow.env"), **read_env_file(folder / "minio.env")}
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
    stranger = s3_client("stranger", "not-a-key")
    with pytest.raises(botocore.exceptions.ClientError):
        stranger.list_objects_v2(Bucket="ddpflow")
    # The workers' key reaches the bucket only: it cannot make another.
    worker = s3_client(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):
        worker.create_bucket(Bucket="not-ddpflow")
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
    context = ssl.create_default_context(cafile=str(stack["folder"] / "https" / "ca.pem"))
    assert _status("https://127.0.0.1:5443/health", context=context) == 200
    assert _status("https://127.0.0.1:5443/api/2.0/mlflow/experiments/search?max_results=1",
                   context=context) == 401  # fmt: skip
