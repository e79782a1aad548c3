"""Whether the workers reach the flow's Prefect API: the probe against real local sockets, the
check against the answers a cluster gives (the Dask side is in test_external_cluster.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddpflow.preflight.checks import (
    PreflightError,
    check_workers_reach_api,
    probe_http,
    probe_http_off_loop,
)
from infra.procs import free_port

pytestmark = pytest.mark.integration


class _Status(BaseHTTPRequestHandler):
    status = 401  # a server behind auth: it answers, so it is reachable

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def answering_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api/health"
    finally:
        server.shutdown()
        server.server_close()


def test_any_http_answer_counts_as_reachable(answering_url: str) -> None:
    assert probe_http(answering_url, timeout=3) is None
    assert asyncio.run(probe_http_off_loop(answering_url, 3)) is None


def test_a_closed_port_is_reported_with_its_reason() -> None:
    started = time.monotonic()
    why = probe_http(f"http://127.0.0.1:{free_port()}/api/health", timeout=3)
    assert why and "refused" in why.lower()
    assert time.monotonic() - started < 3


def test_every_worker_reaching_the_api_passes() -> None:
    asked: list[tuple[str, float]] = []

    def probe_workers(url: str, timeout_s: float) -> dict[str, object]:
        asked.append((url, timeout_s))
        return {"tcp://10.0.0.1:1": None, "tcp://10.0.0.2:1": None}

    check_workers_reach_api("http://10.0.0.9:4200/api/", probe_workers, timeout_s=2)
    assert asked == [("http://10.0.0.9:4200/api/health", 2)]


def test_unreachable_workers_are_named_with_the_url_and_the_fix() -> None:
    answers = {
        "tcp://10.0.0.1:1": None,
        "tcp://10.0.0.2:1": "[Errno 111] Connection refused",
        "tcp://10.0.0.3:1": OSError("the probe itself failed"),
    }
    with pytest.raises(PreflightError) as info:
        check_workers_reach_api("http://127.0.0.1:8251/api", lambda *_: answers, embedded=True)
    message = str(info.value)
    assert "2 of 3 Dask workers cannot reach the flow's embedded Prefect API" in message
    assert "tcp://10.0.0.2:1: [Errno 111] Connection refused" in message
    assert "tcp://10.0.0.3:1: OSError: the probe itself failed" in message
    assert "tcp://10.0.0.1:1" not in message
    assert "GET http://127.0.0.1:8251/api/health" in message
    assert "prefect server start --host 0.0.0.0" in message and "PREFECT_API_URL" in message


def test_workers_that_cannot_be_asked_fail_the_check() -> None:
    def no_answer(url: str, timeout_s: float) -> dict[str, object]:
        raise TimeoutError("no answer within 15s")

    with pytest.raises(PreflightError, match="could not ask every Dask worker.*TimeoutError"):
        check_workers_reach_api("http://prefect.example.org:4200/api", no_answer)
