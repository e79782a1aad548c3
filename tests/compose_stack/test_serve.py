"""The compose recipe's S3 entry point (`python -m infra.seaweedfs.serve`) run on this machine,
without Docker: the same command the `s3` service runs, on a free port and temporary folders.

It makes the bucket before it reports ready, keeps the keys out of weed's argv and
environment, and stops on SIGTERM within seconds (weed 4.48 alone would take minutes).
The compose test (test_compose_stack.py) runs it in the recipe's container.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import psutil
import pytest

from infra.procs import free_port
from infra.seaweedfs import serve
from infra.seaweedfs.server import STOP_WAIT_S, grpc_socket_paths, weed_binary

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KEYS = {
    "S3_ADMIN_ACCESS_KEY_ID": "serve-test-admin",
    "S3_ADMIN_SECRET_ACCESS_KEY": "admin-secret-of-the-serve-test",
    "AWS_ACCESS_KEY_ID": "serve-test-worker",
    "AWS_SECRET_ACCESS_KEY": "worker-secret-of-the-serve-test",
}


def _start(tmp_path: Path, port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "infra.seaweedfs.serve", "--port", str(port), "--bind", "127.0.0.1",
        "--data", str(tmp_path / "data"), "--config", str(tmp_path / "config"),
        "--bucket", "ddpflow",
    ]  # fmt: skip
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _weed_of(proc: subprocess.Popen[str]) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children()
        if children:
            return children[0]
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    raise AssertionError("serve started no weed")


def test_serve_is_ready_with_its_bucket_and_stops_on_sigterm(tmp_path: Path) -> None:
    weed_binary()  # the dev extra installs it; a clear error if not
    port = free_port()
    env = {**os.environ, **KEYS}
    proc = _start(tmp_path, port, env)
    try:
        weed = _weed_of(proc)
        ready = tmp_path / "config" / serve.READY
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "serve did not report ready in 90 s"
            time.sleep(0.2)
        # Ready means the bucket exists, for the workers' key.
        worker = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            region_name="us-east-1",
            aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
        )
        worker.put_object(Bucket="ddpflow", Key="k", Body=b"v")
        # The keys reach weed through identities.json (0600) alone.
        cmdline, weed_env = " ".join(weed.cmdline()), weed.environ()
        for name, value in KEYS.items():
            assert value not in cmdline and value not in weed_env.values(), name
            assert name not in weed_env, name
        assert oct((tmp_path / "config" / "identities.json").stat().st_mode & 0o777) == "0o600"
        grpc = dict(re.findall(r"-(\w+)\.port\.grpc=(\d+)", cmdline))
        sockets = grpc_socket_paths({f"{name}_grpc": int(port) for name, port in grpc.items()})
        assert any(path.exists() for path in sockets)

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_WAIT_S + 20) == 0, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() - started < STOP_WAIT_S + 10
        assert not weed.is_running() or weed.status() == psutil.STATUS_ZOMBIE
        leftovers = [path for path in sockets if path.exists()]
        assert not leftovers, leftovers  # a later server on these ports would trip over them
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_to_start_without_a_key(tmp_path: Path) -> None:
    env = {k: v for k, v in {**os.environ, **KEYS}.items() if k != "AWS_SECRET_ACCESS_KEY"}
    proc = _start(tmp_path, free_port(), env)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert "AWS_SECRET_ACCESS_KEY not set" in output
    assert not any(value in output for value in KEYS.values())
    assert not (tmp_path / "config").exists(), "nothing written before the keys are checked"
