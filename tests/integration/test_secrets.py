"""Credentials in a URI reach no output, Prefect record, MLflow store or artifact.

The flow runs through its command line's own code (`flows.cli.run_cli`, what `python -m
flows.train_charlm` runs, which redacts a refused value before Prefect records it) in this
process, on the module's Prefect API and Dask cluster (flow_services). Prefect's records are
read back through its client, and every file the run could have written to (the project's
MLflow store and artifacts, the API's database) is searched byte by byte. The download task's
failure runs in a process of its own, against the project's own Prefect database.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL

from ddpflow.preflight.checks import PreflightError, check_tracking
from flows.train_charlm import train_charlm
from tests.helpers.in_process import cli_exit_code
from tests.helpers.prefect_harness import database_files
from tests.helpers.prefect_reads import flow_run_records, latest_flow_run, own_tag
from tests.helpers.projects import project_env, tiny_charlm

pytestmark = pytest.mark.integration
# Distinctive, so a match cannot be a coincidence.
PASSWORD, KEY = "Pw-7q1xZ", "Kx-93vQ"
# Refused before any training: the flow's own default source.
TINY = tiny_charlm(1, source=None)

# Prefect's records read back through its client, in the process that ran the flow (its
# embedded API still up): every flow run, task run (state and message), log and artifact.
READ_RECORDS = """
import json
from prefect.client.orchestration import get_client

with get_client(sync_client=True) as client:
    records = {
        "flow_runs": [r.model_dump(mode="json") for r in client.read_flow_runs()],
        "task_runs": [r.model_dump(mode="json") for r in client.read_task_runs()],
        "logs": [r.model_dump(mode="json") for r in client.read_logs()],
        "artifacts": [r.model_dump(mode="json") for r in client.read_artifacts()],
    }
print(json.dumps(records))
"""

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


def assert_no_file_holds_a_secret(project: Path, *more: Path) -> None:
    files = [p for p in project.rglob("*") if p.is_file()] + list(more)
    assert any(p.name.startswith("prefect.db") for p in files), "Prefect's database was searched"
    for path in files:
        data = path.read_bytes()
        assert PASSWORD.encode() not in data and KEY.encode() not in data, path


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def refused(flow_services: str, monkeypatch, capfd):
    """Run train-charlm's command line with `args` in `project`, on flow_services; check that
    it exits 1 and that nothing it printed, no record of it and no file holds a credential.
    Returns its error output (the failure line) and its records."""

    def run(args: list[str], project: Path, env: dict[str, str]) -> tuple[str, dict]:
        capfd.readouterr()
        # Every line Prefect logs, whichever handlers the test session gave it.
        logged = _Collect()
        logging.getLogger("prefect").addHandler(logged)
        try:
            with own_tag() as tag:  # this run's, in an API other processes share
                code = cli_exit_code(train_charlm, args, project, flow_services, monkeypatch, env)
        finally:
            logging.getLogger("prefect").removeHandler(logged)
        output = capfd.readouterr()
        assert code == 1, output.err[-3000:]
        assert_clean(output.out + output.err, "flow output")
        assert_clean("\n".join(logged.lines), "Prefect's log lines")
        # Refused before any task: every log line is this process's. Send them all now.
        with contextlib.suppress(RuntimeError):  # none was logged to the API
            APILogWorker.instance().drain()
        records = flow_run_records(latest_flow_run(train_charlm.name, tag).id)
        assert_clean(json.dumps(records), "Prefect flow run, task runs, logs, artifacts")
        # MLflow's store, the artifact root, the API's database and the results Prefect kept
        # (the failed state's exception) wherever its result storage is.
        kept = [Path(key) for key in re.findall(r'"storage_key": "([^"]+)"', json.dumps(records))]
        assert kept and all(p.is_file() for p in kept), f"Prefect's kept results: {kept}"
        database = database_files(PREFECT_API_URL.value())
        assert_no_file_holds_a_secret(project, *database, *kept)
        return output.err, records

    return run


def test_flow_refuses_a_source_with_credentials_and_records_it_redacted(tmp_path, refused):
    source = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}/missing.json?key={KEY}#frag"
    stderr, records = refused(["--source", source, *TINY], tmp_path, {})
    assert "can carry a credential" in stderr and "~/.netrc" in stderr, stderr[-3000:]
    assert "http://alice:***@127.0.0.1:" in stderr
    [flow_run] = records["flow_runs"]
    assert flow_run["state"]["type"] == "FAILED"
    assert "can carry a credential" in flow_run["state"]["message"]
    assert flow_run["parameters"]["training"]["source"].startswith("http://alice:***@127.0.0.1:")


# docs/security.md "Credentials never go in a parameter": every error shows URIs redacted,
# in the terminal and in Prefect.
def test_tracking_uri_credentials_stay_out_of_the_error_text_and_its_records(tmp_path, refused):
    """The error text names the tracking URI (its user:password@ included) and Prefect keeps
    it as the flow run's state message and in its logs."""
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}"
    stderr, records = refused(TINY, tmp_path, {"MLFLOW_TRACKING_URI": uri})
    assert "MLflow tracking server http://alice:***@127.0.0.1:" in stderr, stderr[-3000:]
    [flow_run] = records["flow_runs"]
    assert flow_run["state"]["type"] == "FAILED"
    assert "MLflow tracking server http://alice:***@" in flow_run["state"]["message"]
    assert any("alice:***@" in log["message"] for log in records["logs"]), "the error was logged"


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
