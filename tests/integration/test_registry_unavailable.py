"""A tracking server that answers 503 (a load balancer while MLflow is down), served on
127.0.0.1: reading the champion fails, naming the fix, and is never taken for "no champion"."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from ddpflow.registry.read import RegistryError
from ddpflow.workloads.charlm.champion import champion_version, promote

pytestmark = pytest.mark.integration


class Unavailable(http.server.BaseHTTPRequestHandler):
    """What a tracking server behind a load balancer answers while it is down."""

    def _answer(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def unavailable_mlflow(monkeypatch) -> Iterator[str]:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_unavailable_registry_is_not_taken_for_no_champion(unavailable_mlflow):
    started = time.monotonic()
    with_password = unavailable_mlflow.replace("http://", "http://alice:s3cret-pw@")
    with pytest.raises(RegistryError, match="cannot read the 'champion' alias") as error:
        champion_version(with_password, "any-model")
    assert "nothing was changed" in str(error.value)
    assert "s3cret-pw" not in str(error.value)
    with pytest.raises(RegistryError, match="cannot read the 'champion' alias"):
        promote(unavailable_mlflow, "any-model", "0" * 32, "2", "unused", margin=0.0)
    assert time.monotonic() - started < 30
