"""An MLflow outage during a training loses nothing, or says exactly what is missing.

Real processes: a real MLflow tracking server (SQLite store, artifacts in a folder), which
the test stops and starts again on the same store and port; the pet-name flow against it.

The flow runs in a thread of the test's own process (start_in_process), on a Prefect API
server the module shares (prefect_api_url) and on a 2-worker Dask LocalCluster of each test's
own: the settings under test (DDPFLOW_TRACKING_SPOOL_MB, DDPFLOW_TRACKING_FLUSH_TIMEOUT_S,
MLFLOW_HTTP_REQUEST_MAX_RETRIES) are read where rank 0's MLflow logger and its spool run,
in a worker process, so each test starts its workers with its own environment (the flow
gets it too). A `python -m flows.train_charlm` run per test would start its own Prefect
server and cluster and import everything again: about 15-20 CPU-seconds each. What the
flow logs the test reads back from the API; what the spool logs in the worker process
(never sent to Prefect), the test collects there (tests/helpers/worker_logs.py).
"""

from __future__ import annotations

import concurrent.futures
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from ddpflow.tracking.loggers import BackgroundMlflowLogger, RunRef
from ddpflow.tracking.one_try import OneTryCalls
from ddpflow.tracking.run import TRACKING_INCOMPLETE_TAG
from ddpflow.training.batching import epoch_batches
from flows.params import CharLMParams
from flows.train_charlm import train_charlm
from infra.services import Service, free_port, start_mlflow, stop
from tests.helpers.charlm_runs import EPOCHS, TINY_PARAMS, wait_for_checkpoint
from tests.helpers.in_process import start_in_process
from tests.helpers.prefect_reads import flow_run_logs, flow_run_records
from tests.helpers.projects import tiny_charlm_params
from tests.helpers.worker_logs import cluster_keeping_logs, worker_log

pytestmark = pytest.mark.integration
# Two minutes: twice the 60 s after which the old logger dropped what was queued.
OUTAGE_S = 120
# The fault tests' tiny training: epochs 2 and 3 (about 3 s each) run while MLflow is down,
# and the end of training then waits for it on disk (what a long outage looks like).
OUTAGE_RUN = TINY_PARAMS
ARTIFACT_KEY = "charlm-tracking-incomplete"
SPOOL_LOGGER = "ddpflow.tracking.spool"


class MlflowServer:
    """One tracking server whose process can be stopped and started again on its store."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.store = root / "server.db"
        self.artifacts = root / "server-artifacts"
        self.service: Service | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.service = start_mlflow(
            self.port, f"sqlite:///{self.store}", self.artifacts.as_uri(), {}, self.root
        )

    def stop(self) -> None:
        if self.service is not None:
            stop(self.service)
            self.service = None

    def store_client(self) -> MlflowClient:
        """The server's own SQLite store, read directly: it works while the server is down."""
        return MlflowClient(f"sqlite:///{self.store}")

    def checkpoints(self, run_id: str) -> list[str]:
        found = self.artifacts.glob(f"*/{run_id}/artifacts/checkpoints/*.pt")
        return sorted(p.name for p in found)


@pytest.fixture
def mlflow_server(tmp_path) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path / "mlflow")
    try:
        yield server
    finally:
        server.stop()


def start_flow(
    project: Path,
    client: distributed.Client,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    training: dict[str, Any],
) -> concurrent.futures.Future:
    """The flow in a thread of this process, on the client's cluster, with `env` set; the
    future gives its final state."""
    params = CharLMParams(**training)
    address = client.scheduler.address
    return start_in_process(train_charlm, project, address, monkeypatch, env, training=params)


def the_run_id(client: MlflowClient) -> str:
    runs = client.search_runs([client.get_experiment_by_name("ddpflow-charlm").experiment_id])
    assert len(runs) == 1
    return runs[0].info.run_id


def expected_train_steps(client: MlflowClient, run_id: str) -> list[int]:
    """The train_loss steps of an uninterrupted run (fit logs every 20th step)."""
    params = client.get_run(run_id).data.params
    per_epoch = len(
        epoch_batches(
            int(params["num_train_samples"]), int(params["batch_size"]), 0,
            int(params["world_size"]), int(params["seed"]), 0,
        )
    )  # fmt: skip
    return [e * per_epoch + s for e in range(EPOCHS) for s in range(20, per_epoch + 1, 20)]


def test_a_two_minute_outage_mid_run_loses_no_metric_and_no_checkpoint(
    mlflow_server, prefect_api_url, tmp_path, monkeypatch
):
    project = tmp_path / "project"
    env = {"MLFLOW_TRACKING_URI": mlflow_server.url}
    with cluster_keeping_logs(env, SPOOL_LOGGER) as cluster:
        flow_run = start_flow(project, cluster, monkeypatch, env, OUTAGE_RUN)
        wait_for_checkpoint(project, 1, flow_run)
        mlflow_server.stop()
        down_at = time.monotonic()
        last = project.glob(f"artifacts/runs/*/checkpoints/epoch-{EPOCHS:04d}.pt")
        assert not list(last), "training ended before the outage began: use slower epochs"
        time.sleep(OUTAGE_S)  # the outage itself: a fixed length is the point of the test
        waiting = list(project.glob("artifacts/runs/*/tracking-spool/*/*.json"))
        assert waiting, "calls logged during the outage should wait on disk"
        mlflow_server.start()
        print(f"MLflow was down for {time.monotonic() - down_at:.0f} s")
        state = flow_run.result(timeout=600)
        print(f"the flow ended {time.monotonic() - down_at:.0f} s after MLflow went down")
    out = flow_run_logs(state.state_details.flow_run_id, "tracking           complete")
    assert state.is_completed(), f"{state}\n{out[-5000:]}"

    client = mlflow_server.store_client()
    run_id = the_run_id(client)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert TRACKING_INCOMPLETE_TAG not in run.data.tags
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert sorted(steps) == expected_train_steps(client, run_id), "each step exactly once"
    for key in ("val_loss", "epoch_train_loss"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3]
    wanted = [f"epoch-{e:04d}.pt" for e in range(1, EPOCHS + 1)]
    assert mlflow_server.checkpoints(run_id) == wanted
    assert run.data.tags["ddpflow.latest_checkpoint"].endswith(wanted[-1])
    assert "tracking           complete" in out
    assert not list(project.glob("artifacts/runs/*/tracking-spool/*")), "nothing left waiting"


def test_logging_resumes_within_its_own_retry_wait_once_mlflow_is_back(
    mlflow_server, tmp_path, monkeypatch
):
    """A metric logged while MLflow is down reaches it within the logging thread's own wait
    (retry_max_s) once the server answers again, not when MLflow's client would next retry:
    with a back-off factor of 60 that retry comes 120 s after the second failure (after the
    two-minute outage above, the flow so waited two more minutes)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "60")
    client = MlflowClient(mlflow_server.url)
    run_id = client.create_run(client.create_experiment("resume")).info.run_id
    run = RunRef(mlflow_server.url, run_id)
    logger = BackgroundMlflowLogger(run, spool_dir=tmp_path / "spool", retry_max_s=1.0)
    try:
        mlflow_server.stop()
        logger.log_metrics({"loss": 1.0}, step=1)
        time.sleep(3)  # the logging thread has tried, and failed, meanwhile
        assert not logger.flush(0), "nothing can reach a stopped server"
        mlflow_server.start()
        back = time.monotonic()
        assert logger.flush(30), "MLflow did not get the metric within 30 s of its return"
        print(f"MLflow had the metric {time.monotonic() - back:.1f} s after it answered again")
    finally:
        logger.close()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]


def test_a_call_whose_server_goes_away_mid_call_is_tried_once(tmp_path, monkeypatch):
    """The logging thread's calls are not retried inside MLflow's client, which sleeps up to
    120 s between tries: a call in flight when the server went away went in up to two
    minutes after the server was back. Each call is one connection; the thread's own waits
    decide the next try. A socket that accepts each connection and closes it unanswered
    stands in for a server stopping in the middle of a call (a real server cannot be stopped
    at that exact point). MLflow's back-off is set to 0 only so that a regression fails in
    seconds, not minutes."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    connections = 0

    def drop_every_connection(listener: socket.socket) -> None:
        nonlocal connections
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener closed: the test is over
                return
            connections += 1
            conn.close()

    with socket.create_server(("127.0.0.1", 0)) as listener:
        threading.Thread(target=drop_every_connection, args=(listener,), daemon=True).start()
        calls = OneTryCalls(f"http://127.0.0.1:{listener.getsockname()[1]}", "0" * 32)
        checkpoint = tmp_path / "epoch-0001.pt"
        checkpoint.write_bytes(b"checkpoint bytes")
        tries = {
            "log_batch": lambda: calls.log_batch(metrics=[Metric("loss", 1.0, 0, 1)]),
            "logged_steps": lambda: calls.logged_steps("loss"),
            "log_artifact": lambda: calls.log_artifact(str(checkpoint), "checkpoints"),
        }
        for name, call in tries.items():
            before = connections
            with pytest.raises(Exception, match="Connection aborted|RemoteDisconnected"):
                call()
            time.sleep(0.2)  # a retry would have connected again by now
            assert connections - before == 1, f"{name} connected {connections - before} times"


def test_mlflow_gone_for_good_the_flow_lists_exactly_what_is_missing(
    mlflow_server, prefect_api_url, tmp_path, monkeypatch
):
    """MLflow stops after epoch 1 and never comes back. The end-of-training wait is cut to
    5 s (DDPFLOW_TRACKING_FLUSH_TIMEOUT_S) and MLflow's client does not retry
    (MLFLOW_HTTP_REQUEST_MAX_RETRIES=0), or evaluation would retry a dead server for minutes."""
    project = tmp_path / "project"
    env = {
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        "DDPFLOW_TRACKING_FLUSH_TIMEOUT_S": "5",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    with cluster_keeping_logs(env, SPOOL_LOGGER) as cluster:
        flow_run = start_flow(project, cluster, monkeypatch, env, OUTAGE_RUN)
        wait_for_checkpoint(project, 1, flow_run)
        mlflow_server.stop()
        state = flow_run.result(timeout=600)
    flow_run_id = state.state_details.flow_run_id
    out = f"{state}\n" + flow_run_logs(flow_run_id, "is missing")
    # Evaluation and registration need MLflow: the flow fails there, after training.
    assert state.is_failed(), out[-5000:]
    records = flow_run_records(flow_run_id)
    artifacts = {a["key"]: a for a in records["artifacts"] if a["key"]}
    assert ARTIFACT_KEY in artifacts, out[-5000:]
    markdown = artifacts[ARTIFACT_KEY]["data"]
    listed = re.findall(r"^\| \d+ \| (.+?) \| (.+?) \| (.+?) \|$", markdown, re.MULTILINE)
    assert listed, markdown
    assert all(Path(path).exists() for _, path, _ in listed), "each waits on disk"

    client = mlflow_server.store_client()
    run_id = the_run_id(client)
    checkpoint_dir = next(project.glob("artifacts/runs/*/checkpoints"))
    missing: dict[str, set[int]] = {}  # metric key -> steps listed as missing
    missing_checkpoints, missing_tags = set(), set()
    for what, _, origin in listed:
        if metrics := re.fullmatch(r"metrics (.+) at step (\d+)", what):
            for key in metrics[1].split(", "):
                missing.setdefault(key, set()).add(int(metrics[2]))
        elif what.startswith("artifact checkpoints/"):
            missing_checkpoints.add(what.rsplit("/", 1)[-1])
            assert origin == str(checkpoint_dir / what.rsplit("/", 1)[-1])
        elif what.startswith("pruning checkpoints/ to "):
            # The copies MLflow would have dropped (keep_last) wait too: named, not lost.
            assert re.fullmatch(r"pruning checkpoints/ to (epoch-\d{4}\.pt(, )?)+", what), what
        else:
            assert what.startswith("tags ddpflow.latest_checkpoint="), what
            missing_tags.add(what.split("=", 1)[1])
    # Every point fit logs is in MLflow once or listed, never both.
    train_steps = expected_train_steps(client, run_id)
    epoch_keys = ("epoch_train_loss", "val_loss", "epoch_samples_per_s", "epoch_time_s")
    expected = {"train_loss": train_steps, "samples_per_s": train_steps}
    expected.update({key: [1, 2, 3] for key in epoch_keys})
    assert set(missing) <= set(expected)
    for key, steps in expected.items():
        logged = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(logged) == len(set(logged)), f"{key}: a step twice"
        assert not set(logged) & missing.get(key, set()), f"{key}: listed but in MLflow"
        assert sorted(set(logged) | missing.get(key, set())) == steps, f"{key}: steps lost"
    in_mlflow = set(mlflow_server.checkpoints(run_id))
    assert in_mlflow | missing_checkpoints == {f"epoch-{e:04d}.pt" for e in range(1, 4)}
    assert not in_mlflow & missing_checkpoints
    tag = client.get_run(run_id).data.tags.get("ddpflow.latest_checkpoint", "epoch-0000")
    tagged = int(re.findall(r"epoch-(\d+)", tag)[-1])
    newer = {str(checkpoint_dir / f"epoch-{e:04d}.pt") for e in range(tagged + 1, EPOCHS + 1)}
    assert missing_tags == newer, "the tags MLflow lacks are exactly those listed"
    assert f"missing {len(listed)} logging calls" in out
    # Nobody can tag or end a run on a server that is gone: it stays RUNNING, untagged.
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and TRACKING_INCOMPLETE_TAG not in run.data.tags


def test_a_full_spool_ends_the_run_tagged_and_the_summary_says_so(
    prefect_api_url, tmp_path, monkeypatch
):
    """A spool of 20 KB: the metrics fit, the checkpoints (about 60 KB each) do not. MLflow
    (the project's SQLite store) is up, so the run can be tagged and finished."""
    project = tmp_path / "project"
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
        "DDPFLOW_TRACKING_SPOOL_MB": "0.02",
    }
    training = tiny_charlm_params(2, hidden_size=64)
    with cluster_keeping_logs(env, SPOOL_LOGGER) as cluster:
        state = start_flow(project, cluster, monkeypatch, env, training).result(timeout=600)
        spooled = worker_log(cluster, SPOOL_LOGGER)  # rank 0's spool logs in its worker process
    flow_run_id = state.state_details.flow_run_id
    incomplete = "tracking           INCOMPLETE: 2 logging calls are not in MLflow"
    out = flow_run_logs(flow_run_id, incomplete)
    assert state.is_completed(), f"{state}\n{out[-5000:]}"
    assert "is full" in spooled and "NOT kept" in spooled, spooled
    assert incomplete in out
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    run_id = the_run_id(client)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[TRACKING_INCOMPLETE_TAG].startswith(
        "2 logging calls are not in this run (2 not kept: the spool was full)"
    )
    assert client.list_artifacts(run_id, "checkpoints") == []
    artifacts = {a["key"]: a for a in flow_run_records(flow_run_id)["artifacts"] if a["key"]}
    markdown = artifacts[ARTIFACT_KEY]["data"]
    checkpoint_dir = next(project.glob("artifacts/runs/*/checkpoints"))
    for epoch in (1, 2):
        name = f"epoch-{epoch:04d}.pt"
        assert f"artifact checkpoints/{name} | not kept: the spool was full" in markdown
        assert str(checkpoint_dir / name) in markdown
