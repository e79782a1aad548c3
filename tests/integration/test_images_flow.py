"""The image flow end to end on a SeaweedFS S3 server over HTTP: digits, 2 ranks, ResNet-18.

One training run (2 epochs at 16 px, the digits' 8 x 8 pixels upscaled twice), a sharded
one, and two runs that must fail before training: too many unreadable files, and a single
class. The flow runs in the test's process on the module's flow_services, whose workers
have the S3 endpoint and keys in their environment, as a user's workers would.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter

import mlflow
import numpy as np
import pytest
import torch

from ddpflow.workloads.vision.digits import digits_pngs, write_digits
from ddpflow.workloads.vision.image_folder import DatasetError
from ddpflow.workloads.vision.reports import read_confusion_csv
from ddpflow.workloads.vision.split import num_held_out
from flows.params import ImageParams
from flows.train_images import train_images
from tests.helpers.in_process import run_in_process
from tests.helpers.prefect_reads import completed_task_runs, flow_run_logs
from tests.helpers.projects import project_tracking
from tests.helpers.s3_servers import (
    ACCESS_KEY,
    SECRET_KEY,
    list_keys,
    s3_client,
    s3_env,
    use_s3,
)

pytestmark = pytest.mark.integration

BUCKET = "ddpflow-images"  # the conftest's `s3_endpoint` fixture creates it
EPOCHS = 2
IMAGE_SIZE = 16
# Measured on 2 CPU cores at 32 px: 0.91 after 2 epochs, 0.936-0.939 after 3; at 16 px 0.89
# after 2 (chance is 0.10). The model and its all-reduced gradients are the same size at
# either: 16 px saves a tenth of the training, the module no more.
MIN_VAL_ACCURACY = 0.8
PARAMS = {
    "arch": "resnet18",
    "weights": "none",
    "image_size": IMAGE_SIZE,
    "epochs": EPOCHS,
    "batch_size": 32,
    "lr": 0.001,
    "world_size": 2,
    "keep_last": 2,
    # Accepted end to end; on CPU "auto" resolves to fp32, contiguous, unpinned.
    "precision": "auto",
    "channels_last": "auto",
    "pin_memory": "false",
}
CORRUPT_KEY = "artifacts/data/digits/3/corrupt.png"


@pytest.fixture(scope="module")
def digits(s3_endpoint) -> str:
    """The digits folder where the flow's default source looks, plus one corrupt PNG."""
    root = f"s3://{BUCKET}/artifacts/data/digits"
    with pytest.MonkeyPatch.context() as patch:
        use_s3(patch, s3_endpoint)
        write_digits(root)
    s3_client(s3_endpoint).put_object(
        Bucket=BUCKET, Key=CORRUPT_KEY, Body=b"\x89PNG\r\n not really"
    )
    return root


@pytest.fixture(scope="module")
def flow_services_env(s3_endpoint) -> dict[str, str]:
    return s3_env(s3_endpoint)


def _env(prefix: str) -> dict[str, str]:
    return {"DDPFLOW_ARTIFACT_ROOT": f"s3://{BUCKET}/{prefix}"}


def train(project, flow_services, monkeypatch, prefix: str, **params: object) -> tuple:
    """One train-images run in this process: its log lines and its flow run id (a refusal
    raises). The log is complete once the flow's summary and the workers' warning about the
    digits' corrupt file (both trainings read it) have arrived."""
    state = run_in_process(
        train_images,
        project,
        flow_services,
        monkeypatch,
        env=_env(prefix),
        training=ImageParams(**{**PARAMS, **params}),
        return_state=True,
    )
    state.result()
    logs = flow_run_logs(
        state.state_details.flow_run_id, "image classifier trained", "unreadable image file(s)"
    )
    return logs, state.state_details.flow_run_id


@pytest.fixture(scope="module")
def trained(s3_endpoint, digits, flow_services, tmp_path_factory) -> dict:
    project = tmp_path_factory.mktemp("images")
    with pytest.MonkeyPatch.context() as patch:
        logs, _ = train(project, flow_services, patch, "artifacts")
    client = project_tracking(project)
    runs = client.search_runs([client.get_experiment_by_name("ddpflow-images").experiment_id])
    assert len(runs) == 1
    return {
        "output": logs,  # the flow prints its summary into its log
        "client": client,
        "run": runs[0],
        "keys": list_keys(s3_endpoint, BUCKET),
    }


def _history(trained: dict, key: str) -> list[tuple[int, float]]:
    metrics = trained["client"].get_metric_history(trained["run"].info.run_id, key)
    return sorted((m.step, m.value) for m in metrics)


def test_validation_accuracy_is_well_above_chance(trained):
    val_accuracy = _history(trained, "val_accuracy")
    assert [step for step, _ in val_accuracy] == list(range(1, EPOCHS + 1))
    final = trained["run"].data.metrics["final_val_accuracy"]
    assert final >= MIN_VAL_ACCURACY, val_accuracy
    assert final == pytest.approx(val_accuracy[-1][1], abs=1e-6), "same model, same number"
    assert f"val accuracy       {final:.2%}" in trained["output"]
    assert "majority-class baseline" in trained["output"] and "WARNING" not in trained["output"]


def test_per_step_metrics_and_lr_scaled_by_world_size(trained):
    for key in ("train_loss", "train_accuracy", "lr"):
        assert len(_history(trained, key)) >= EPOCHS, key
    assert {value for _, value in _history(trained, "lr")} == {0.002}, "0.001 x 2 ranks"
    assert [step for step, _ in _history(trained, "val_loss")] == list(range(1, EPOCHS + 1))
    params = trained["run"].data.params
    assert params["world_size"] == "2" and float(params["effective_lr"]) == 0.002
    assert (params["precision"], params["channels_last"], params["pin_memory"]) == (
        "auto",
        "auto",
        "False",
    )
    resolved = json.loads(trained["run"].data.tags["ddpflow.speed"])
    assert (resolved["precision"], resolved["channels_last"]) == ("fp32", False)
    assert resolved["fused_optimizer"] is True  # Adam as one kernel per step on the CPU ranks


def test_confusion_matrix_sums_to_the_validation_set_size(trained, s3_endpoint):
    from sklearn.datasets import load_digits

    expected = sum(num_held_out(n, 0.2) for n in Counter(load_digits().target).values())
    run_id = trained["run"].info.run_id
    prefix = f"artifacts/runs/{run_id}/reports"
    body = s3_client(s3_endpoint).get_object(Bucket=BUCKET, Key=f"{prefix}/confusion_matrix.csv")
    classes, confusion = read_confusion_csv(body["Body"].read().decode())
    assert classes == [str(d) for d in range(10)]
    assert sum(map(sum, confusion)) == expected == int(trained["run"].data.params["num_val"])
    assert f"{prefix}/confusion_matrix.png" in trained["keys"]
    assert f"{prefix}/per_class_accuracy.json" in trained["keys"]
    local = trained["client"].download_artifacts(run_id, "evaluation/confusion_matrix.csv")
    with open(local) as f:
        assert read_confusion_csv(f.read())[1] == confusion
    assert "val_class_accuracy/3" in trained["run"].data.metrics


def test_corrupt_image_is_skipped_with_a_warning_naming_its_key(trained):
    assert "skipped 1 unreadable image file(s) of 1798" in trained["output"]
    assert f"s3://{BUCKET}/{CORRUPT_KEY}" in trained["output"]
    assert trained["run"].data.params["num_skipped_files"] == "1"


def test_credentials_appear_in_no_output_param_or_tag(trained):
    run = trained["run"]
    recorded = " ".join([*run.data.params.values(), *run.data.tags.values(), trained["output"]])
    assert SECRET_KEY not in recorded and ACCESS_KEY not in recorded


def test_inputs_system_metrics_and_version_tags_are_recorded(trained, s3_endpoint):
    """The image workload records what tests/integration/test_inspection.py checks for charlm:
    its S3 inputs with content digests, a system-metric series per rank, a described version."""
    run = trained["run"]
    inputs = {
        next(t.value for t in i.tags if t.key == "mlflow.data.context"): i.dataset
        for i in run.inputs.dataset_inputs
    }
    assert set(inputs) == {"training", "validation"}
    for dataset in inputs.values():
        uri = json.loads(dataset.source)["uri"]
        assert dataset.source_type == "s3" and uri.startswith(f"s3://{BUCKET}/artifacts/"), uri
        key = uri.removeprefix(f"s3://{BUCKET}/")
        content = s3_client(s3_endpoint).get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert dataset.digest == hashlib.sha256(content).hexdigest()[:32]
        assert SECRET_KEY not in dataset.source and ACCESS_KEY not in dataset.source
    assert "system/rank0/cpu_utilization_percentage" in run.data.metrics
    assert "system/rank1/cpu_utilization_percentage" in run.data.metrics
    version = trained["client"].get_model_version("ddpflow-images", "1")
    assert version.tags["ddpflow.workload"] == "images"
    assert (
        version.tags["metric.final_val_accuracy"] == f"{run.data.metrics['final_val_accuracy']:.4f}"
    )
    assert inputs["training"].digest in version.description
    # Like the pet-name model's: the version names the checkpoint it was registered from.
    assert version.tags["ddpflow.checkpoint_uri"] == run.data.tags["ddpflow.latest_checkpoint"]


def test_checkpoints_in_s3_and_the_registered_model_serves_uint8_images(trained, s3_endpoint):
    run_id = trained["run"].info.run_id
    prefix = f"artifacts/runs/{run_id}/checkpoints"
    names = sorted(k.rsplit("/", 1)[1] for k in trained["keys"] if k.startswith(prefix))
    assert names == [f"epoch-{EPOCHS - 1:04d}.pt", f"epoch-{EPOCHS:04d}.pt", "latest.json"]
    body = s3_client(s3_endpoint).get_object(Bucket=BUCKET, Key=f"{prefix}/epoch-{EPOCHS:04d}.pt")
    state = torch.load(io.BytesIO(body["Body"].read()), weights_only=True)
    assert state["model_config"]["arch"] == "resnet18" and "scheduler_state" in state
    mlflow.set_tracking_uri(trained["client"].tracking_uri)
    model = mlflow.pytorch.load_model("models:/ddpflow-images/1")
    logits = model(torch.from_numpy(np.zeros((3, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)))
    assert tuple(logits.shape) == (3, 10)


def test_too_many_bad_files_fail_clearly_before_training(
    s3_endpoint, flow_services, monkeypatch, tmp_path
):
    # 20 digits of 2 classes and one corrupt file: the check reads every file, so a small
    # folder keeps the test to the flow's start-up.
    client = s3_client(s3_endpoint)
    pngs = digits_pngs()
    for label in ("0", "1"):
        for key in sorted(k for k in pngs if k.startswith(f"{label}/"))[:10]:
            client.put_object(Bucket=BUCKET, Key=f"few/{key}", Body=pngs[key])
    corrupt = "few/1/corrupt.png"
    client.put_object(Bucket=BUCKET, Key=corrupt, Body=b"\x89PNG\r\n not really")
    with pytest.raises(DatasetError) as failed:
        train(
            tmp_path, flow_services, monkeypatch, "strict",
            source=f"s3://{BUCKET}/few", max_bad_fraction=0,
        )  # fmt: skip
    message = str(failed.value)
    assert "1 of 21 image files" in message and "max_bad_fraction=0" in message, message[-3000:]
    assert f"s3://{BUCKET}/{corrupt}" in message
    assert list_keys(s3_endpoint, BUCKET, "strict/runs/") == []


def test_single_class_folder_fails_before_training_and_writes_no_run(
    s3_endpoint, flow_services, monkeypatch, tmp_path
):
    client = s3_client(s3_endpoint)
    for i in range(3):
        client.put_object(Bucket=BUCKET, Key=f"one-class/7/{i}.png", Body=b"unread")
    source = f"s3://{BUCKET}/one-class"
    with pytest.raises(DatasetError) as failed:
        train(tmp_path, flow_services, monkeypatch, "single", source=source)
    assert f"{source} has only one class folder ('7')" in str(failed.value), failed.value
    assert list_keys(s3_endpoint, BUCKET, "single/") == []
    tracking = project_tracking(tmp_path)
    experiment = tracking.get_experiment_by_name("ddpflow-images")
    assert experiment is None or not tracking.search_runs([experiment.experiment_id])


# docs/data.md: with --data-layout shards the folder is formatted by one task per chunk on
# the cluster's workers into shards in the S3 store, and every rank streams its part.
def test_a_sharded_run_formats_on_the_workers_and_streams_from_s3(
    s3_endpoint, digits, flow_services, monkeypatch, tmp_path
):
    sharded = {"data_layout": "shards", "shard_mb": 0.25, "augment": "true", "source": digits}
    output, flow_run_id = train(tmp_path, flow_services, monkeypatch, "sharded", **sharded)
    keys = list_keys(s3_endpoint, BUCKET, "sharded/data/image-shards/")
    shards = [k for k in keys if k.endswith(".shard")]
    # A list, not a set: Prefect names a task run by 3 hex digits, which can repeat.
    runs = completed_task_runs(flow_run_id)
    chunk_runs = [name for name in runs if name.startswith("format-image-chunk-")]
    assert len(shards) == len(chunk_runs) >= 4, (keys, chunk_runs)
    assert len([k for k in keys if k.endswith(".shards.json")]) == 2
    assert "streamed from shards" in output
    assert "skipped 1 unreadable image file(s) of 1798" in output
    client = project_tracking(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("ddpflow-images").experiment_id])
    assert run.data.params["data_layout"] == "shards" and run.data.params["augment"] == "True"
    # Two epochs of ResNet-18 on augmented 8 x 8 digits train (the training loss falls),
    # but their validation accuracy is too noisy to bound: 0.28-0.50 measured (0.92
    # without augmentation, which suits digits less than photos).
    history = client.get_metric_history(run.info.run_id, "epoch_train_loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert int(run.data.params["num_val"]) == len(
        json.loads(
            s3_client(s3_endpoint).get_object(Bucket=BUCKET, Key=_val_keys(keys))["Body"].read()
        )
    )


def _val_keys(keys: list[str]) -> str:
    (found,) = [k for k in keys if k.endswith("-val_keys.json")]
    return found
