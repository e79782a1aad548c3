"""Credentials in a URI reach no output, Prefect record, MLflow store or artifact.

The flow runs the way a user runs it (`python -m flows.train_charlm`); Prefect's records are
read back through its client from the project's own database, and every file the run left
behind (Prefect's and MLflow's SQLite files included) is searched byte by byte.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ddpflow.preflight.checks import PreflightError, check_tracking
from tests.integration.conftest import (
    READ_RECORDS,
    prefect_records,
    project_env,
    run_flow,
    tiny_charlm,
)

pytestmark = pytest.mark.integration
# Distinctive, so a match cannot be a coincidence.
PASSWORD, KEY = "Pw-7q1xZ", "Kx-93vQ"
TINY = tiny_charlm(1)

# A flow of its own (no parameters) that hands the download task a source with credentials:
# the task's error, its state and the flow's state must not repeat them.
# Its records are read in the same process, saving a second ephemeral server start.
DOWNLOAD_FLOW = (
    """
import os, traceback
from prefect import flow
from tasks.charlm import download_corpus

@flow(name="download-only")
def download_only():
    download_corpus(os.environ["SECRET_SOURCE"], os.environ["DDPFLOW_ARTIFACT_ROOT"])

try:
    download_only()
except Exception:
    traceback.print_exc()
"""
    + READ_RECORDS
)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_clean(text: str, where: str) -> None:
    assert PASSWORD not in text and KEY not in text, f"{where}: {text[-3000:]}"


def assert_no_file_holds_a_secret(project: Path) -> None:
    files = [p for p in project.rglob("*") if p.is_file()]
    assert any(p.name.startswith("prefect.db") for p in files), "Prefect's database was searched"
    for path in files:
        data = path.read_bytes()
        assert PASSWORD.encode() not in data and KEY.encode() not in data, path


def test_flow_refuses_a_source_with_credentials_and_records_it_redacted(tmp_path):
    project = tmp_path / "project"
    source = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}/missing.json?key={KEY}#frag"
    result = run_flow("train_charlm", ["--source", source, *TINY], project, timeout_s=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "can carry a credential" in result.stderr and "~/.netrc" in result.stderr, output[-3000:]
    assert "http://alice:***@127.0.0.1:" in result.stderr
    assert_clean(output, "flow output")

    records = prefect_records(project)
    [flow_run] = records["flow_runs"]
    assert flow_run["state"]["type"] == "FAILED"
    assert "can carry a credential" in flow_run["state"]["message"]
    assert flow_run["parameters"]["training"]["source"].startswith("http://alice:***@127.0.0.1:")
    assert_clean(json.dumps(records), "Prefect flow run, task runs, logs, artifacts")
    assert_no_file_holds_a_secret(project)  # MLflow's store and the artifact root included


# docs/security.md "Credentials never go in a parameter": every error shows URIs redacted,
# in the terminal and in Prefect.
def test_tracking_uri_credentials_stay_out_of_the_error_text_and_its_records(tmp_path):
    """The error text names the tracking URI (its user:password@ included) and Prefect keeps
    it as the flow run's state message and in its logs."""
    project = tmp_path / "project"
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}"
    result = run_flow("train_charlm", TINY, project, env={"MLFLOW_TRACKING_URI": uri})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "MLflow tracking server http://alice:***@127.0.0.1:" in result.stderr, output[-3000:]
    assert_clean(output, "flow output")
    records = prefect_records(project)
    [flow_run] = records["flow_runs"]
    assert flow_run["state"]["type"] == "FAILED"
    assert "MLflow tracking server http://alice:***@" in flow_run["state"]["message"]
    assert any("alice:***@" in log["message"] for log in records["logs"]), "the error was logged"
    assert_clean(json.dumps(records), "Prefect flow run, task runs, logs, artifacts")
    assert_no_file_holds_a_secret(project)


@pytest.fixture
def missing_file_server() -> Iterator[int]:
    """Answers 404 to everything, on 127.0.0.1."""

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_download_task_failure_repeats_no_credential(tmp_path, missing_file_server):
    project = tmp_path / "project"
    project.mkdir()
    port = missing_file_server
    source = f"http://alice:{PASSWORD}@127.0.0.1:{port}/missing.json?key={KEY}#frag"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DOWNLOAD_FLOW)],
        cwd=project,
        env={**project_env(project), "SECRET_SOURCE": source},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "FileNotFoundError" in result.stderr, output[-3000:]
    assert_clean(output, "flow output, records included")

    records = json.loads(result.stdout.strip().splitlines()[-1])
    [task_run] = records["task_runs"]
    assert task_run["state"]["type"] == "FAILED"
    assert f"http://alice:***@127.0.0.1:{port}/missing.json" in task_run["state"]["message"]
    assert records["flow_runs"][0]["state"]["type"] == "FAILED"
    assert_clean(json.dumps(records), "Prefect flow run, task runs, logs, artifacts")
    assert_no_file_holds_a_secret(project)


def test_tracking_preflight_sends_url_credentials_as_basic_auth():
    """MLflow's client sends user:password@ as basic auth; the pre-flight probe must too."""
    wanted = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()

    class Tracking(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            ok = self.headers.get("Authorization") == wanted
            body = b"{}" if ok else b""
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Tracking)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        check_tracking(f"http://alice:{PASSWORD}@127.0.0.1:{port}", timeout_s=5)
        with pytest.raises(PreflightError, match="Unauthorized") as info:
            check_tracking(f"http://alice:wrong-{KEY}@127.0.0.1:{port}", timeout_s=5)
        assert "alice:***@" in str(info.value)
        assert_clean(str(info.value), "pre-flight error")
    finally:
        server.shutdown()
        server.server_close()
