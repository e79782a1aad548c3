"""Pre-flight logs in to an MLflow server behind basic auth the way MLflow's client does.

The server is a stand-in (a stdlib HTTP server on 127.0.0.1 that checks the Authorization
header of the one endpoint pre-flight calls): MLflow's real auth app takes ~20 s to start,
and tests/integration/test_stack.py runs that one.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddpflow.preflight.checks import PreflightError, check_tracking

pytestmark = pytest.mark.integration

GOOD = "Basic " + base64.b64encode(b"alice:s3cret").decode()


class _AuthOnly(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        ok = self.headers.get("Authorization") == GOOD
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(b'{"experiments": []}' if ok else b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _AuthOnly)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_sends_the_tracking_credentials(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    check_tracking(server, timeout_s=5)


def test_missing_credentials_name_the_settings(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(PreflightError, match="Unauthorized.*MLFLOW_TRACKING_USERNAME"):
        check_tracking(server, timeout_s=5)
