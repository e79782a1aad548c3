"""S3 for real: a SeaweedFS server over HTTP and an MLflow server whose artifacts go to S3.

The flow runs in the test's process on the module's flow_services (a Prefect API and two
Dask worker processes that have the S3 endpoint and keys in their environment, as a user's
workers would); what it recorded is read back from that API."""

from __future__ import annotations

import io
import json
import time

import pytest
import s3fs
import torch
from mlflow.tracking import MlflowClient

from ddpflow.config import STORE_OUTAGE_ENV
from ddpflow.preflight.checks import PreflightError, check_artifact_store, check_tracking
from flows.params import CharLMParams
from flows.train_charlm import train_charlm
from infra.services import free_port
from tests.helpers.in_process import run_in_process
from tests.helpers.prefect_reads import completed_task_runs, flow_run_logs, flow_run_records
from tests.helpers.projects import tiny_charlm_params
from tests.helpers.s3_servers import (
    ACCESS_KEY,
    SECRET_KEY,
    list_keys,
    mlflow_server,
    s3_client,
    s3_env,
    use_s3,
    with_aws_keys,
    without_aws_credentials,
)

pytestmark = pytest.mark.integration
BUCKET = "ddpflow-it"  # the conftest's `s3_endpoint` fixture creates it
TINY_PARAMS = tiny_charlm_params(2, keep_last=2)


@pytest.fixture(scope="module")
def flow_services_env(s3_endpoint) -> dict[str, str]:
    return s3_env(s3_endpoint)


@pytest.fixture(scope="module")
def s3_run(s3_endpoint, flow_services, tmp_path_factory) -> dict:
    """One flow run: artifact root on S3, MLflow server with an S3 artifact destination."""
    logs = tmp_path_factory.mktemp("mlflow-server")
    with (
        mlflow_server(logs, s3_endpoint, f"s3://{BUCKET}/mlflow") as server,
        pytest.MonkeyPatch.context() as patch,
    ):
        project = tmp_path_factory.mktemp("s3-project")
        env = {
            "DDPFLOW_ARTIFACT_ROOT": f"s3://{BUCKET}/artifacts",
            "MLFLOW_TRACKING_URI": server.url,
        }
        training = CharLMParams(**TINY_PARAMS)
        state = run_in_process(
            train_charlm, project, flow_services, patch, env, training=training, return_state=True
        )
        assert state.is_completed(), state
        flow_run_id = state.state_details.flow_run_id
        output = flow_run_logs(flow_run_id, "registered model")
        client = MlflowClient(server.url)
        run = client.search_runs([client.get_experiment_by_name("ddpflow-charlm").experiment_id])[0]
        assert run.data.tags["prefect.flow_run_id"] == str(flow_run_id)
        history = client.get_metric_history(run.info.run_id, "val_loss")
        # Every flow run, task run (states and their messages), log and artifact.
        records = flow_run_records(flow_run_id)
        yield {
            "output": output,
            "run": run,
            "val_loss": history,
            "flow_run": json.dumps(records["flow_runs"][0]),
            "prefect_records": json.dumps(records),
            "keys": list_keys(s3_endpoint, BUCKET),
        }


def test_data_checkpoints_and_reports_are_objects_in_the_bucket(s3_run):
    keys, run_id = s3_run["keys"], s3_run["run"].info.run_id
    prefix = f"artifacts/runs/{run_id}"
    assert any(k.startswith("artifacts/data/raw/") and k.endswith(".json") for k in keys)
    assert any(k.startswith("artifacts/data/formatted/") and k.endswith("train.pt") for k in keys)
    assert f"{prefix}/checkpoints/epoch-0002.pt" in keys
    assert f"{prefix}/checkpoints/latest.json" in keys
    assert f"{prefix}/reports/evaluation.md" in keys
    assert not [k for k in keys if ".ddpflow-preflight" in k], "the probe was cleaned up"


def test_checkpoint_loads_from_s3_with_weights_only(s3_run, s3_endpoint, monkeypatch):
    use_s3(monkeypatch, s3_endpoint)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    path = f"{BUCKET}/artifacts/runs/{s3_run['run'].info.run_id}/checkpoints/epoch-0002.pt"
    with fs.open(path, "rb") as f:
        state = torch.load(io.BytesIO(f.read()), weights_only=True)
    assert state["epoch"] == 2 and "lstm.weight_ih_l0" in state["model_state"]


def test_mlflow_server_keeps_model_and_checkpoints_in_s3(s3_run):
    keys = s3_run["keys"]
    mlflow_keys = [k for k in keys if k.startswith("mlflow/")]
    assert any(k.endswith("checkpoints/epoch-0002.pt") for k in mlflow_keys), mlflow_keys
    assert any(k.endswith("/MLmodel") for k in mlflow_keys), mlflow_keys
    assert [m.step for m in s3_run["val_loss"]] == [1, 2]


# docs/security.md "Where credentials never appear": no key reaches a log, a Prefect record,
# MLflow or an object.
def test_credentials_appear_nowhere(s3_run, s3_endpoint):
    # The records were read: the flow run with its parameters, and its artifacts.
    assert '"hidden_size": 16' in s3_run["flow_run"], s3_run["flow_run"][-3000:]
    assert "charlm-evaluation" in s3_run["prefect_records"], "the artifacts were read"
    run = s3_run["run"]
    recorded = " ".join([*run.data.params.values(), *run.data.tags.values()])
    for secret in (SECRET_KEY, ACCESS_KEY):
        assert secret not in s3_run["output"], "flow logs"
        assert secret not in recorded, "MLflow params/tags"
        assert secret not in s3_run["flow_run"], "Prefect flow run and its parameters"
        assert secret not in s3_run["prefect_records"], "Prefect runs, states, logs, artifacts"
    s3 = s3_client(s3_endpoint)
    assert s3_run["keys"], "the bucket holds the run's objects"
    for key in s3_run["keys"]:  # every object: data, checkpoints, reports, MLflow's
        body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert SECRET_KEY.encode() not in body and ACCESS_KEY.encode() not in body, key


def _assert_fast_failure(check, match: str) -> None:
    started = time.monotonic()
    with pytest.raises(PreflightError, match=match):
        check()
    assert time.monotonic() - started < 20


def test_missing_bucket_fails_preflight_and_writes_nothing(s3_endpoint, monkeypatch):
    """SeaweedFS 4.48 creates a missing bucket on its administrator's first write (AWS and
    moto answer NoSuchBucket): pre-flight asks for the bucket first (HeadBucket), so a
    mistyped name fails naming it and no bucket is made."""
    use_s3(monkeypatch, s3_endpoint)
    before = list_keys(s3_endpoint, BUCKET)
    _assert_fast_failure(
        lambda: check_artifact_store("s3://no-such-bucket-xyz/run"),
        "Bucket 'no-such-bucket-xyz' does not exist",
    )
    assert list_keys(s3_endpoint, BUCKET) == before
    buckets = [b["Name"] for b in s3_client(s3_endpoint).list_buckets()["Buckets"]]
    assert "no-such-bucket-xyz" not in buckets


@pytest.mark.parametrize(
    ("access_key_id", "secret_access_key"),
    [("AKIADDPFLOWUNKNOWN42", SECRET_KEY), (ACCESS_KEY, "not-the-secret-of-this-key")],
    ids=["unknown-key", "wrong-secret"],
)
def test_wrong_credentials_fail_preflight_with_an_access_message(
    s3_endpoint, monkeypatch, access_key_id, secret_access_key
):
    """The server refuses a key it does not know and a known key signed with another secret
    (403: InvalidAccessKeyId, SignatureDoesNotMatch); nothing is written."""
    use_s3(monkeypatch, s3_endpoint)
    before = list_keys(s3_endpoint, BUCKET)
    with with_aws_keys(monkeypatch, access_key_id, secret_access_key):
        _assert_fast_failure(
            lambda: check_artifact_store(f"s3://{BUCKET}/run"),
            "Access denied: check AWS_ACCESS_KEY_ID",
        )
    assert list_keys(s3_endpoint, BUCKET) == before


# docs/s3-and-servers.md "Pre-flight": names a missing credential and its fix, writing nothing.
def test_no_aws_credentials_fail_preflight_naming_the_variables(s3_endpoint, monkeypatch):
    use_s3(monkeypatch, s3_endpoint)
    before = list_keys(s3_endpoint, BUCKET)
    with without_aws_credentials(monkeypatch):
        _assert_fast_failure(
            lambda: check_artifact_store(f"s3://{BUCKET}/no-keys"),
            r"artifact store s3://ddpflow-it/no-keys: .*NoCredentialsError.* No AWS "
            "credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        )
    assert list_keys(s3_endpoint, BUCKET) == before


# docs/s3-and-servers.md "Pre-flight": names an unreachable S3 endpoint and its setting.
def test_unreachable_s3_endpoint_fails_preflight_naming_the_setting(monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    use_s3(monkeypatch, endpoint)
    _assert_fast_failure(
        lambda: check_artifact_store(f"s3://{BUCKET}/run"),
        rf"artifact store s3://ddpflow-it/run: .* The S3 endpoint at {endpoint} "
        r"\(AWS_ENDPOINT_URL_S3\) is unreachable: check AWS_ENDPOINT_URL_S3",
    )


def test_unreachable_mlflow_fails_in_seconds_naming_the_setting():
    uri = f"http://127.0.0.1:{free_port()}"
    _assert_fast_failure(lambda: check_tracking(uri, timeout_s=5), "MLFLOW_TRACKING_URI")


def test_flow_stops_on_unreachable_mlflow_before_writing(
    s3_endpoint, flow_services, tmp_path, monkeypatch
):
    uri = f"http://127.0.0.1:{free_port()}"
    env = {"DDPFLOW_ARTIFACT_ROOT": f"s3://{BUCKET}/unreachable", "MLFLOW_TRACKING_URI": uri}
    started = time.monotonic()
    state = run_in_process(
        train_charlm, tmp_path, flow_services, monkeypatch, env,
        training=CharLMParams(**TINY_PARAMS), return_state=True,
    )  # fmt: skip
    assert state.is_failed(), state
    assert f"MLflow tracking server {uri} is not usable" in state.message, state.message
    assert time.monotonic() - started < 60
    assert list_keys(s3_endpoint, BUCKET, "unreachable/") == []
    assert completed_task_runs(state.state_details.flow_run_id) == [], "before any task"


def test_interrupted_checkpoint_upload_keeps_pointer_on_previous(s3_endpoint, monkeypatch):
    from ddpflow.checkpoint.store import CheckpointStore, build_state
    from ddpflow.workloads.charlm.config import CharLSTMConfig
    from ddpflow.workloads.charlm.model import CharLSTM

    use_s3(monkeypatch, s3_endpoint)
    model = CharLSTM(CharLSTMConfig(hidden_size=8, num_layers=1))
    optimizer = torch.optim.Adam(model.parameters())
    store = CheckpointStore(f"s3://{BUCKET}/interrupted-{time.time_ns()}", keep_last=3)
    for epoch in (1, 2):
        store.save(build_state(model, optimizer, epoch, model.config.to_dict()))

    original = s3fs.S3FileSystem._call_s3

    async def drop_epoch_3(self, method, *args, **kwargs):
        if str(kwargs.get("Key", "")).endswith("epoch-0003.pt"):
            raise ConnectionResetError("connection dropped mid-upload")
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", drop_epoch_3)
    monkeypatch.setenv(STORE_OUTAGE_ENV, "1")  # retried for a second, then given up
    with pytest.raises(OSError, match="connection dropped mid-upload"):
        store.save(build_state(model, optimizer, 3, model.config.to_dict()))
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", original)

    assert store.latest_uri().endswith("epoch-0002.pt")
    assert store.load()["epoch"] == 2
    prefix = store.root.removeprefix(f"s3://{BUCKET}/")
    assert not [k for k in list_keys(s3_endpoint, BUCKET, prefix) if k.endswith("epoch-0003.pt")]
