"""The download task's source handling over a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddpflow import storage
from ddpflow.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.charlm.data import fetch_corpus

pytestmark = pytest.mark.integration
BODY = DEFAULT_CORPUS_PATH.read_bytes()


class FlakyServer(ThreadingHTTPServer):
    """Serves /names.json, failing the first `failures` requests with 503."""

    def __init__(self, failures: int):
        super().__init__(("127.0.0.1", 0), FlakyHandler)
        self.failures = failures
        self.requests: list[tuple[str, str, int]] = []


class FlakyHandler(BaseHTTPRequestHandler):
    server: FlakyServer

    def _respond(self, with_body: bool) -> None:
        if self.path != "/names.json":
            status = 404
        elif self.server.failures > 0:
            self.server.failures -= 1
            status = 503
        else:
            status = 200
        self.server.requests.append((self.command, self.path, status))
        self.send_response(status)
        self.send_header("Content-Length", str(len(BODY) if status == 200 else 0))
        self.end_headers()
        if with_body and status == 200:
            self.wfile.write(BODY)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._respond(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._respond(with_body=False)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(request) -> Iterator[FlakyServer]:
    srv = FlakyServer(failures=getattr(request, "param", 0))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("server", [2], indirect=True)
def test_transient_http_errors_are_retried(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}/names.json"
    copy = fetch_corpus(url, str(tmp_path))
    assert storage.read_bytes(copy.uri) == BODY
    assert [s for _, _, s in server.requests].count(503) == 2


def test_missing_url_fails_at_once_naming_the_source(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}/missing.json"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        fetch_corpus(url, str(tmp_path))
    assert len(server.requests) <= 2, "a 404 is not retried"
    assert not (tmp_path / "data").exists()


def test_second_fetch_of_the_same_bytes_is_reused(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}/names.json"
    first, second = fetch_corpus(url, str(tmp_path)), fetch_corpus(url, str(tmp_path))
    assert not first.reused and second.reused and first.uri == second.uri
