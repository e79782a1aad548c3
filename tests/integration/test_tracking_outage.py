"""An MLflow outage during a training loses nothing, or says exactly what is missing.

Real processes: the pet-name flow as a user runs it (`python -m flows.train_charlm`, its own
Dask LocalCluster) against a real MLflow tracking server (SQLite store, artifacts in a
folder), which the test stops and starts again on the same store and port.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.tracking.loggers import BackgroundMlflowLogger, RunRef
from ddpflow.tracking.run import TRACKING_INCOMPLETE_TAG
from ddpflow.training.batching import epoch_batches
from infra.services import Service, free_port, start_mlflow, stop
from tests.integration.charlm_runs import EPOCHS, TINY, small_corpus, wait_for_checkpoint
from tests.integration.conftest import (
    REPO,
    prefect_records,
    project_env,
    run_flow,
    tiny_charlm,
)

pytestmark = pytest.mark.integration
# Two minutes: twice the 60 s after which the old logger dropped what was queued.
OUTAGE_S = 120
# The fault tests' tiny training: epochs 2 and 3 (about 3 s each) run while MLflow is down,
# and the end of training then waits for it on disk (what a long outage looks like).
OUTAGE_RUN = TINY
ARTIFACT_KEY = "charlm-tracking-incomplete"


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


def start_flow(project: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """The flow in the background, its output in project/flow.log (a pipe could fill up)."""
    project.mkdir(parents=True, exist_ok=True)
    log = open(project / "flow.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "flows.train_charlm", *args],
        cwd=project,
        env={**project_env(project), **env, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


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


def test_a_two_minute_outage_mid_run_loses_no_metric_and_no_checkpoint(mlflow_server, tmp_path):
    project = tmp_path / "project"
    proc = start_flow(project, OUTAGE_RUN, {"MLFLOW_TRACKING_URI": mlflow_server.url})
    try:
        wait_for_checkpoint(project, 1, proc)
        mlflow_server.stop()
        down_at = time.monotonic()
        last = project.glob(f"artifacts/runs/*/checkpoints/epoch-{EPOCHS:04d}.pt")
        assert not list(last), "training ended before the outage began: use slower epochs"
        time.sleep(OUTAGE_S)  # the outage itself: a fixed length is the point of the test
        waiting = list(project.glob("artifacts/runs/*/tracking-spool/*/*.json"))
        assert waiting, "calls logged during the outage should wait on disk"
        mlflow_server.start()
        print(f"MLflow was down for {time.monotonic() - down_at:.0f} s")
        proc.wait(timeout=600)
        print(f"the flow ended {time.monotonic() - down_at:.0f} s after MLflow went down")
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (project / "flow.log").read_text()
    assert proc.returncode == 0, out[-5000:]

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


def test_mlflow_gone_for_good_the_flow_lists_exactly_what_is_missing(mlflow_server, tmp_path):
    """MLflow stops after epoch 1 and never comes back. The end-of-training wait is cut to
    5 s (DDPFLOW_TRACKING_FLUSH_TIMEOUT_S) and MLflow's client does not retry
    (MLFLOW_HTTP_REQUEST_MAX_RETRIES=0), or evaluation would retry a dead server for minutes."""
    project = tmp_path / "project"
    env = {
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        "DDPFLOW_TRACKING_FLUSH_TIMEOUT_S": "5",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    proc = start_flow(project, OUTAGE_RUN, env)
    try:
        wait_for_checkpoint(project, 1, proc)
        mlflow_server.stop()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (project / "flow.log").read_text()
    # Evaluation and registration need MLflow: the flow fails there, after training.
    assert proc.returncode != 0, out[-5000:]
    artifacts = {a["key"]: a for a in prefect_records(project)["artifacts"] if a["key"]}
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


def test_a_full_spool_ends_the_run_tagged_and_the_summary_says_so(tmp_path):
    """A spool of 20 KB: the metrics fit, the checkpoints (about 60 KB each) do not. MLflow
    (the project's SQLite store) is up, so the run can be tagged and finished."""
    project = tmp_path / "project"
    result = run_flow(
        "train_charlm",
        [*tiny_charlm(2, hidden_size=64), "--source", str(small_corpus())],
        project,
        env={"DDPFLOW_TRACKING_SPOOL_MB": "0.02"},
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert "is full" in out and "NOT kept" in out
    assert "tracking           INCOMPLETE: 2 logging calls are not in MLflow" in out
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    run_id = the_run_id(client)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[TRACKING_INCOMPLETE_TAG].startswith(
        "2 logging calls are not in this run (2 not kept: the spool was full)"
    )
    assert client.list_artifacts(run_id, "checkpoints") == []
    artifacts = {a["key"]: a for a in prefect_records(project)["artifacts"] if a["key"]}
    markdown = artifacts[ARTIFACT_KEY]["data"]
    checkpoint_dir = next(project.glob("artifacts/runs/*/checkpoints"))
    for epoch in (1, 2):
        name = f"epoch-{epoch:04d}.pt"
        assert f"artifact checkpoints/{name} | not kept: the spool was full" in markdown
        assert str(checkpoint_dir / name) in markdown
