"""The workers' pre-flight probe of a tracking server whose URI carries basic-auth credentials
(http://user:password@host:port), against a real HTTP server on 127.0.0.1 that requires them,
probed from real Dask workers (the `dask_client` LocalCluster).

urllib reads `user:password@host` as the host: without a port it raised
`nonnumeric port: 'password@host'` (the password in the pre-flight error), with one it looked
up a host of that name and reported a reachable server as unreachable.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import distributed
import pytest

from ddpflow.config import Settings
from ddpflow.preflight.checks import PreflightError, probe_http
from flows.preflight import check_workers_reach_stores
from infra.procs import free_port

pytestmark = pytest.mark.integration

USER, PASSWORD = "alice", "S3CRET@PW:x"  # '@' and ':' as a real password may have them
QUOTED = "S3CRET%40PW%3Ax"  # how it is written in a URI
SECRETS = (PASSWORD, QUOTED, "S3CRET")


@dataclass
class Seen:
    """What the server was sent: each request's line, Host header and whether it was let in."""

    requests: list[tuple[str, str, bool]] = field(default_factory=list)


@pytest.fixture()
def auth_server() -> Iterator[tuple[int, Seen]]:
    seen = Seen()
    expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            allowed = self.headers.get("Authorization") == expected
            seen.requests.append((self.requestline, self.headers.get("Host", ""), allowed))
            self.send_response(200 if allowed else 401)
            if not allowed:
                self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def assert_clean(text: str) -> None:
    assert not [s for s in SECRETS if s in text], text


def test_probe_sends_the_urls_credentials_as_basic_auth(auth_server: tuple[int, Seen]) -> None:
    port, seen = auth_server
    assert probe_http(f"http://{USER}:{QUOTED}@127.0.0.1:{port}/health", timeout=5) is None
    assert len(seen.requests) == 1
    line, host, allowed = seen.requests[0]
    assert allowed, "the server did not get the URL's user and password as basic auth"
    assert line.startswith("GET /health ") and host == f"127.0.0.1:{port}"
    assert_clean(line + host)


def test_probe_without_a_port_does_not_fail_on_the_credentials() -> None:
    """The default port: urllib's `nonnumeric port: 'S3CRET...@127.0.0.1'` before the fix."""
    reason = probe_http(f"http://{USER}:{QUOTED}@127.0.0.1/health", timeout=3)
    if reason is not None:  # nothing listens on port 80 here: the connection is refused
        assert "nonnumeric" not in reason and "refused" in reason.lower(), reason
        assert_clean(reason)


def test_probe_of_a_token_only_user_info(auth_server: tuple[int, Seen]) -> None:
    port, seen = auth_server
    assert probe_http(f"http://TOKEN@127.0.0.1:{port}/health", timeout=5) is None
    assert seen.requests and not seen.requests[0][2]  # sent as TOKEN: and refused: reachable


def test_workers_reach_a_tracking_server_behind_basic_auth(
    dask_client: distributed.Client, auth_server: tuple[int, Seen], tmp_path: Path
) -> None:
    port, seen = auth_server
    settings = Settings.from_env(
        env={"MLFLOW_TRACKING_URI": f"http://{USER}:{QUOTED}@127.0.0.1:{port}"},
        project_dir=tmp_path,
    )
    check_workers_reach_stores(dask_client, settings, timeout_s=5)
    assert len(seen.requests) == 2 and all(allowed for *_, allowed in seen.requests), seen


def test_a_worker_that_cannot_reach_it_names_no_credential(
    dask_client: distributed.Client, tmp_path: Path
) -> None:
    for netloc in (f"{USER}:{QUOTED}@127.0.0.1:{free_port()}", f"{USER}:{QUOTED}@127.0.0.1"):
        settings = Settings.from_env(
            env={"MLFLOW_TRACKING_URI": f"http://{netloc}"}, project_dir=tmp_path
        )
        try:
            check_workers_reach_stores(dask_client, settings, timeout_s=3)
        except PreflightError as error:
            message = str(error)
            assert "2 of 2 Dask workers cannot reach MLflow tracking server" in message
            assert f"http://{USER}:***@127.0.0.1" in message and "nonnumeric" not in message
            assert_clean(message)
        else:
            assert netloc.endswith("127.0.0.1"), "a closed port must fail the check"
