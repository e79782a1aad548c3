"""A registry outage in the middle of a promotion leaves the champion where it was.

A real MLflow tracking server (SQLite) sits behind a small forwarding server on 127.0.0.1
that answers 503 to the first read of one registered model (the champion lookup) and passes
every other request through: a short outage, over by the time the alias could be written.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.registry.read import RegistryError
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.charlm.champion import CHAMPION_ALIAS, promote
from ddpflow.workloads.charlm.evaluation import register_model
from infra.services import free_port, start_mlflow, stop
from tests.helpers.champion_helpers import (
    constant_model,
    start_checkpointed_run,
    unigram_bias,
    write_holdout,
)

pytestmark = pytest.mark.integration
MODEL = "outage-model"
# Reading the registered model or one of its aliases; its versions and runs stay readable.
FAILING_PATHS = ("/registered-models/get", "/registered-models/alias")
HOP_BY_HOP = {"connection", "transfer-encoding", "keep-alive", "content-length"}


def forwarding_handler(upstream: str) -> type[http.server.BaseHTTPRequestHandler]:
    target = urlsplit(upstream)
    outage = threading.Semaphore(1)  # one failed read, then MLflow answers again

    class Forward(http.server.BaseHTTPRequestHandler):
        def _handle(self) -> None:
            path, _, query = self.path.partition("?")
            model_read = path.endswith(FAILING_PATHS) and parse_qs(query).get("name") == [MODEL]
            if self.command == "GET" and model_read and outage.acquire(blocking=False):
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            connection.request(self.command, self.path, body=body, headers=headers)
            reply = connection.getresponse()
            data = reply.read()
            self.send_response(reply.status)
            for key, value in reply.getheaders():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            connection.close()

        do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _handle

        def log_message(self, *args: object) -> None:
            pass

    return Forward


@pytest.fixture
def flaky_mlflow(tmp_path, monkeypatch) -> Iterator[tuple[str, str]]:
    """(direct URL, URL through the forwarder whose first read of MODEL fails)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = start_mlflow(
        free_port(), f"sqlite:///{tmp_path / 'server.db'}", (tmp_path / "artifacts").as_uri(),
        env={}, log_dir=tmp_path,
    )  # fmt: skip
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), forwarding_handler(server.url))
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url, f"http://127.0.0.1:{proxy.server_port}"
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()
        stop(server)


def register(uri: str, model, tmp_path, name: str) -> tuple[str, str]:
    client = MlflowClient(uri)
    run_id = start_checkpointed_run(client, model, tmp_path / "checkpoints")
    checkpoint = client.get_run(run_id).data.tags["ddpflow.latest_checkpoint"]
    return register_model(RunRef(uri, run_id), checkpoint, name), run_id


def test_a_registry_outage_during_promotion_leaves_the_champion_alone(flaky_mlflow, tmp_path):
    direct, flaky = flaky_mlflow
    val_uri = write_holdout(tmp_path)
    client = MlflowClient(direct)
    name = MODEL
    champion, _ = register(direct, constant_model(unigram_bias(val_uri)), tmp_path, name)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, champion)
    worse, worse_run = register(direct, constant_model(unigram_bias(val_uri) * 0), tmp_path, name)

    with pytest.raises(RegistryError, match="cannot read the 'champion' alias") as error:
        promote(flaky, name, worse_run, worse, val_uri, margin=0.0)

    assert "503" in str(error.value) and "nothing was changed" in str(error.value)
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == champion
    assert "ddpflow.retrain.promoted" not in client.get_run(worse_run).data.tags
