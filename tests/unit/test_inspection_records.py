"""ddpflow.tracking.inspection against a real MLflow store (SQLite in a temp folder, no server)."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.distributed.progress import Progress
from ddpflow.tracking.inspection import (
    RunOrigin,
    content_sha256,
    dataset_ref,
    describe_version,
    log_datasets,
    record_decision_on_versions,
    run_description,
)
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import start_run

SECRET = "s3cr3t-pw"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_same_content_has_the_same_digest_wherever_it_is(tmp_path):
    (tmp_path / "a").write_bytes(b"bella\nmax\n")
    (tmp_path / "b").write_bytes(b"bella\nmax\n")
    (tmp_path / "c").write_bytes(b"bella\nmaz\n")
    a, b, c = (dataset_ref("d", str(tmp_path / n), "training") for n in "abc")
    assert a.digest == b.digest != c.digest
    assert len(a.digest) == 32 and a.sha256 == content_sha256(str(tmp_path / "a"))


def test_datasets_are_logged_without_credentials(store, tmp_path):
    (tmp_path / "train.pt").write_bytes(b"x" * 10)
    ref = dataset_ref(
        "names-train",
        str(tmp_path / "train.pt"),
        "training",
        origin=f"https://user:{SECRET}@example.com/names.txt?token={SECRET}",
        profile={"samples": 10},
    )
    run = start_run(store, "inspection", "r", {}, {})
    log_datasets(run, [ref])
    (logged,) = MlflowClient(store).get_run(run.run_id).inputs.dataset_inputs
    assert SECRET not in json.dumps([logged.dataset.source, [t.value for t in logged.tags]])
    assert logged.dataset.digest == ref.digest
    assert json.loads(logged.dataset.profile) == {"samples": 10, "sha256": ref.sha256}
    assert {t.key: t.value for t in logged.tags}["mlflow.data.context"] == "training"


def test_description_names_flow_run_commit_and_data(tmp_path):
    (tmp_path / "f").write_bytes(b"1")
    ref = dataset_ref("f", str(tmp_path / "f"), "validation")
    origin = RunOrigin(
        "train-charlm", "clever-otter", "id-1", "http://ui/runs/flow-run/id-1", "abc"
    )
    text = run_description(origin, "A model", [ref])
    assert "[clever-otter](http://ui/runs/flow-run/id-1)" in text
    assert "`abc`" in text and ref.digest in text


def _version(client: MlflowClient, store: str, name: str) -> tuple[RunRef, str]:
    run = start_run(store, "inspection", "trained", {}, {"ddpflow.workload": "charlm"})
    client.log_metric(run.run_id, "final_val_loss", 1.23456)
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    version = client.create_model_version(name, "file:///nowhere", run_id=run.run_id)
    return run, str(version.version)


def test_version_description_and_tags_come_from_its_run(store, tmp_path):
    client = MlflowClient(store)
    run, version = _version(client, store, "described")
    (tmp_path / "t").write_bytes(b"t")
    log_datasets(run, [dataset_ref("t", str(tmp_path / "t"), "training")])
    describe_version(run, "described", version)
    entry = client.get_model_version("described", version)
    assert entry.tags["metric.final_val_loss"] == "1.2346"
    assert entry.tags["ddpflow.workload"] == "charlm"
    assert entry.tags["ddpflow.run_link"] == f"runs:/{run.run_id}"
    assert entry.tags["data.training.digest"] in entry.description
    assert "final_val_loss: 1.2346" in entry.description


def test_the_decision_is_written_on_both_versions(store):
    client = MlflowClient(store)
    _, champion = _version(client, store, "decided")
    _, challenger = _version(client, store, "decided")
    tags = {"ddpflow.retrain.promoted": "False", "ddpflow.retrain.reason": "not better"}
    record_decision_on_versions(client, "decided", tags, challenger, champion)
    for version, role in ((challenger, "challenger"), (champion, "champion")):
        written = client.get_model_version("decided", version).tags
        assert written["ddpflow.retrain.reason"] == "not better"
        assert written["ddpflow.retrain.role"] == role


def test_step_progress_percent_and_text():
    progress = Progress(step=30, total_steps=120, epoch=1, epochs=4, train_loss=2.5)
    assert progress.percent == 25.0
    assert progress.describe() == "epoch 1/4, step 30/120 (25 %), train loss 2.5000"
    assert Progress.from_event(progress.to_event()) == progress
    # As Dask delivers it: with the sending worker's address added.
    assert Progress.from_event({**progress.to_event(), "worker": "tcp://w:1"}) == progress
    assert Progress.from_event("not a progress event") is None
    # A line alone (ctx.report) travels as the same event type, without step counts.
    line = Progress(line="rank 0 of 2: worker tcp://w:1, pid 7")
    assert Progress.from_event(line.to_event()) == line
    assert not line.has_steps and line.percent == 0.0 and line.describe() == ""
