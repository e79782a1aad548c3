"""Service outages mid-training, for real: the S3 store (a SeaweedFS server) paused for a minute
while a checkpoint is written, and the Prefect server stopped and restarted while a flow runs
against it. Both runs must complete. One tiny training per outage, shared by its tests.

Each flow runs in a thread of this process, on a LocalCluster of its own whose workers get
the environment a user's workers would (the S3 keys; the Prefect API and the client retries
the command line sets). What the flow logs is read back from its Prefect API; what ddpflow
logs in the workers (the checkpoint write's retries) is kept there (worker_logs)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import distributed
import pytest
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from flows.cli import CLIENT_MAX_RETRIES, CLIENT_RETRIES_ENV
from flows.params import CharLMParams
from flows.train_charlm import train_charlm
from infra.services import Service, free_port, start_prefect_server, stop
from tests.helpers import prefect_api
from tests.helpers.charlm_runs import EPOCHS, TINY_PARAMS, wait_for_checkpoint
from tests.helpers.in_process import finish_in_process, start_in_process
from tests.helpers.prefect_harness import api_of_this_process
from tests.helpers.projects import project_tracking
from tests.helpers.s3_servers import (
    ACCESS_KEY,
    SECRET_KEY,
    list_keys,
    mlflow_server,
    s3_env,
    start_test_seaweedfs,
)
from tests.helpers.worker_logs import cluster_keeping_logs, worker_log

pytestmark = pytest.mark.integration
BUCKET = "ddpflow-outage"
S3_OUTAGE_S = 60.0
# Longer than Prefect's own client retries span (about 30 s), shorter than ddpflow's.
PREFECT_OUTAGE_S = 60.0


@contextmanager
def flow_on_its_cluster(
    project: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[concurrent.futures.Future, distributed.Client]]:
    """The tiny training in a thread, on a 2-worker LocalCluster whose workers run with
    `env` (the flow gets it too) and keep what ddpflow logs; yields the flow run's future and
    a client of the cluster, which stops once the flow run is over."""
    with cluster_keeping_logs(env) as client:
        training = CharLMParams(**TINY_PARAMS)
        address = client.scheduler.address
        flow_run = start_in_process(
            train_charlm, project, address, monkeypatch, env, training=training
        )
        try:
            yield flow_run, client
        finally:
            concurrent.futures.wait([flow_run], timeout=600)


def wait_for_first_metric(
    client: MlflowClient, flow_run: concurrent.futures.Future, timeout_s=300
) -> str:
    """The training's run id, once it logged its first training step (mid-epoch 1)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert not flow_run.done(), f"the flow ended first: {flow_run.result()}"
        experiment = client.get_experiment_by_name("ddpflow-charlm")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        if runs and client.get_metric_history(runs[0].info.run_id, "train_loss"):
            return runs[0].info.run_id
        time.sleep(0.3)
    raise AssertionError("the training logged no step")


@pytest.fixture(scope="module")
def s3_service(tmp_path_factory) -> Iterator[Service]:
    """A SeaweedFS S3 server with BUCKET, as a process this module can pause: `weed server`
    is one process (master, volume server, filer and gateway run inside it), so a SIGSTOP
    of it silences every port at once."""
    service = start_test_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), (BUCKET,))
    try:
        yield service
    finally:
        os.kill(service.pid, signal.SIGCONT)  # a stopped process would not stop
        stop(service)


@pytest.fixture(scope="module")
def s3_outage(s3_service, prefect_api_url, tmp_path_factory) -> Iterator[dict]:
    """Checkpoints and MLflow's artifacts on S3; the S3 server is paused (SIGSTOP, which keeps
    its data and its listening socket: connections are accepted, nothing answers) from the
    first training step, before epoch 1's checkpoint, for S3_OUTAGE_S, then resumed."""
    logs, endpoint = tmp_path_factory.mktemp("outage-mlflow"), s3_service.url
    with (
        pytest.MonkeyPatch.context() as monkeypatch,
        mlflow_server(logs, endpoint, f"s3://{BUCKET}/mlflow") as server,
    ):
        env = {
            **s3_env(endpoint),
            "DDPFLOW_ARTIFACT_ROOT": f"s3://{BUCKET}/artifacts",
            "MLFLOW_TRACKING_URI": server.url,
        }
        started = time.monotonic()
        project = tmp_path_factory.mktemp("s3-outage")
        with flow_on_its_cluster(project, env, monkeypatch) as (flow_run, workers):
            client = MlflowClient(server.url)
            try:
                run_id = wait_for_first_metric(client, flow_run)
                os.kill(s3_service.pid, signal.SIGSTOP)
                paused_at = time.monotonic()
                time.sleep(S3_OUTAGE_S)
            finally:
                os.kill(s3_service.pid, signal.SIGCONT)
            state, flow_log = finish_in_process(flow_run, "/3 done")
            output = f"{state}\n{flow_log}\n{worker_log(workers)}"
            result = {
                "completed": state.is_completed(),
                "output": output,
                "run_id": run_id,
                "keys": list_keys(endpoint, BUCKET),
                "checkpoints_in_mlflow": [
                    a.path for a in client.list_artifacts(run_id, "checkpoints")
                ],
            }
    retried = [line for line in output.splitlines() if "checkpoint write to" in line]
    epochs = [line for line in output.splitlines() if "/3 done" in line]
    print(
        f"S3 paused {S3_OUTAGE_S:g} s from {paused_at - started:.0f} s; run took "
        f"{time.monotonic() - started:.0f} s",
        *retried,
        *epochs,
        sep="\n",
    )
    yield result


def test_the_run_survives_a_minute_without_s3(s3_outage):
    assert s3_outage["completed"], s3_outage["output"][-5000:]
    prefix = f"artifacts/runs/{s3_outage['run_id']}/checkpoints"
    keys = set(s3_outage["keys"])
    assert {f"{prefix}/epoch-{e:04d}.pt" for e in range(1, EPOCHS + 1)} <= keys
    assert f"{prefix}/latest.json" in keys


def test_the_checkpoint_write_was_retried_and_said_so(s3_outage):
    output = s3_outage["output"]
    retries = re.findall(r"checkpoint write to s3://\S+ failed \(.*\); attempt \d+", output)
    assert retries, output[-5000:]
    # A paused store times an upload out (no answer); it never refuses it.
    assert "FSTimeoutError" in retries[0]


def test_mlflow_got_every_checkpoint_after_the_outage(s3_outage):
    names = {path.rsplit("/", 1)[-1] for path in s3_outage["checkpoints_in_mlflow"]}
    assert {f"epoch-{e:04d}.pt" for e in range(1, EPOCHS + 1)} <= names


def test_no_credential_in_the_output_of_a_retried_run(s3_outage):
    for secret in (SECRET_KEY, ACCESS_KEY):
        assert secret not in s3_outage["output"]


@pytest.fixture(scope="module")
def prefect_restart(tmp_path_factory) -> Iterator[dict]:
    """A flow against a real Prefect server, which is stopped once epoch 1's checkpoint
    exists and started again PREFECT_OUTAGE_S later on the same port and database. The flow
    and its workers retry the API as the command line has them do (flows.cli)."""
    home = tmp_path_factory.mktemp("prefect-restart")
    port = free_port()
    server = start_prefect_server(port, home, home)
    env = {"PREFECT_API_URL": server.url, CLIENT_RETRIES_ENV: str(CLIENT_MAX_RETRIES)}
    project = tmp_path_factory.mktemp("prefect-restart-project")
    try:
        with (
            pytest.MonkeyPatch.context() as monkeypatch,
            api_of_this_process(server.url),
            temporary_settings({PREFECT_CLIENT_MAX_RETRIES: CLIENT_MAX_RETRIES}),
            flow_on_its_cluster(project, env, monkeypatch) as (flow_run, _),
        ):
            wait_for_checkpoint(project, 1, flow_run)
            stop(server)
            stopped_at = time.monotonic()
            time.sleep(PREFECT_OUTAGE_S)
            server = start_prefect_server(port, home, home)
            back_after_s = time.monotonic() - stopped_at
            state, output = finish_in_process(flow_run)
        _, run = the_only_run(project)
        flow_run_id = run.data.tags["prefect.flow_run_id"]
        yield {
            "completed": state.is_completed(),
            "output": f"{state}\n{output}",
            "flow_run": prefect_api.flow_run(env, flow_run_id),
            "project": project,
            "back_after_s": back_after_s,
        }
        print(f"Prefect server back after {back_after_s:.0f} s")
    finally:
        stop(server)


def the_only_run(project: Path):
    client = project_tracking(project)
    runs = client.search_runs([client.get_experiment_by_name("ddpflow-charlm").experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_the_flow_run_completes_across_a_prefect_server_restart(prefect_restart):
    assert prefect_restart["completed"], prefect_restart["output"][-5000:]
    assert prefect_restart["flow_run"]["state"]["type"] == "COMPLETED", json.dumps(
        prefect_restart["flow_run"]["state"]
    )


def test_the_training_finished_during_the_restart(prefect_restart):
    client, run = the_only_run(prefect_restart["project"])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == list(
        range(1, EPOCHS + 1)
    )
    assert run.info.status == "FINISHED"
