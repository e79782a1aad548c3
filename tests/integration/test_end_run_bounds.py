"""Marking a run's end against an MLflow that is down: bounded, and the original error wins.

Real HTTP on 127.0.0.1: a tiny server that answers 503 to everything (a broken MLflow), and a
port where nothing listens (a dead one). MLflow's client retries both for about 5 minutes.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import end_run

pytestmark = pytest.mark.integration

BOUND_S = 2.0


class _Unavailable(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, *args: object) -> None:  # keep the test output quiet
        pass


@pytest.fixture
def answers_503() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def nothing_listens() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _within(seconds: float, fn: Callable[[], None]) -> BaseException | None:
    """Run `fn` and return what it raised; fail if it is still running after `seconds`
    (without the bound it would run for minutes)."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcome.append(error)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds:g}s"
    return outcome[0]


def _train_then_fail(uri: str) -> None:
    """What every flow does: mark the run FAILED on the way out, then re-raise."""
    run = RunRef(uri, "0" * 32)
    try:
        raise ValueError("the model config cannot be built")
    except ValueError:
        end_run(run, failed=True, timeout_s=BOUND_S)
        raise


@pytest.mark.parametrize("server", ["answers_503", "nothing_listens"])
def test_a_failed_run_against_a_down_mlflow_surfaces_the_original_error(server, request, caplog):
    uri = request.getfixturevalue(server)
    started = time.monotonic()
    error = _within(BOUND_S + 8, lambda: _train_then_fail(uri))
    assert time.monotonic() - started < BOUND_S + 3
    assert isinstance(error, ValueError) and "cannot be built" in str(error)
    assert "stays RUNNING" in caplog.text, "the unmarked run is reported"


def test_a_finished_run_that_cannot_be_marked_raises_within_the_bound(answers_503):
    run = RunRef(answers_503, "0" * 32)
    error = _within(BOUND_S + 8, lambda: end_run(run, timeout_s=BOUND_S))
    assert isinstance(error, TimeoutError) and f"did not finish within {BOUND_S:g}s" in str(error)
    assert answers_503 in str(error), "names the server"


@pytest.mark.parametrize("error", [ValueError("bad batch"), KeyboardInterrupt()])
def test_an_error_inside_failed_on_error_marks_the_run_failed_and_comes_through(tmp_path, error):
    """The one run lifecycle every flow and ddpflow.run use: an error (or an interrupt) in
    the work marks the run FAILED, and the caller sees the original error unchanged."""
    from mlflow.tracking import MlflowClient

    from ddpflow.tracking.run import failed_on_error, start_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = start_run(uri, "lifecycle", "r", {}, {})
    with pytest.raises(type(error)) as raised, failed_on_error(run):
        raise error
    assert raised.value is error
    assert MlflowClient(uri).get_run(run.run_id).info.status == "FAILED"
    ok = start_run(uri, "lifecycle", "ok", {}, {})
    with failed_on_error(ok):
        pass
    assert MlflowClient(uri).get_run(ok.run_id).info.status == "RUNNING", "ending is the caller's"
