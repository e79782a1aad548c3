"""A training whose registration fails keeps its run and checkpoint, and says how to
register it later; `python -m flows.register_checkpoint`'s flow then registers it. The export
runs for real in a fresh process (ddpflow.workloads.registration); the planted failure
replaces only that call, on a real Prefect API (prefect_harness) and a SQLite MLflow.

A registered version loads through `ddpflow.load_registered_model` and nothing in its files
runs: a version registered by ddpflow's own path loads, a `model.pt2` crafted to run code
when unpickled never runs (even with `MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true` set by the
user and a digest tag that matches it), and files that differ from their digest tag are
refused before anything is deserialised."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow.pytorch
import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect import flow

import ddpflow
import tasks.registration
from ddpflow.checkpoint.store import LATEST_CHECKPOINT_TAG
from ddpflow.registry.load import (
    MODEL_DIGEST_TAG,
    PICKLE_SETTING,
    ModelDigestMismatch,
    download_version,
    model_digest,
)
from ddpflow.registry.read import CHAMPION_ALIAS, CHECKPOINT_TAG, RegistryError
from ddpflow.tracking.inspection import WORKLOAD_TAG
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import default_artifact_location
from ddpflow.workloads.charlm.evaluation import load_model
from ddpflow.workloads.charlm.vocab import CONTEXT_LEN, VOCAB_SIZE
from ddpflow.workloads.registration import register_from_checkpoint
from flows.register_checkpoint import register_checkpoint
from tasks.registration import (
    IN_PROCESS_FAILURE_TAG,
    REGISTRATION_FAILED_TAG,
    RegistrationFailed,
    register_trained,
)
from tests.helpers.champion_helpers import constant_model, save_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_api_url")]
MODEL = "ddpflow-charlm-registration"
PLANTED = "RuntimeError: We found a fake tensor in the exported program constant's list"


@pytest.fixture
def trained(tmp_path, monkeypatch) -> dict:
    """A finished pet-name training: its MLflow run (tags and params as the flows record
    them) and its checkpoint."""
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    client = MlflowClient(tracking_uri)
    # Its artifacts beside the store, as the flows keep them: MLflow's default is ./mlruns of
    # the working directory, the checkout.
    location = default_artifact_location(tracking_uri, tmp_path)
    run_id = client.create_run(client.create_experiment("registration", location)).info.run_id
    model = constant_model(torch.zeros(VOCAB_SIZE))
    checkpoint = save_checkpoint(model, tmp_path / "checkpoints")
    client.set_tag(run_id, WORKLOAD_TAG, "charlm")
    client.set_tag(run_id, LATEST_CHECKPOINT_TAG, checkpoint)
    client.log_param(run_id, "model_name", MODEL)
    return {"client": client, "run": RunRef(tracking_uri, run_id), "checkpoint": checkpoint}


@flow
def finish_training(run: RunRef, checkpoint: str) -> str:
    return register_trained("charlm", run, checkpoint, MODEL)


def test_a_failed_registration_keeps_the_training_and_says_how_to_register_it(trained, monkeypatch):
    calls: list[str] = []

    def export_fails(workload: str, run: RunRef, checkpoint: str, name: str) -> str:
        calls.append(checkpoint)
        raise RuntimeError(PLANTED)

    monkeypatch.setattr(tasks.registration, "register_from_checkpoint", export_fails)
    monkeypatch.setattr(tasks.registration, "register_in_fresh_process", export_fails)
    run, client = trained["run"], trained["client"]
    with pytest.raises(RegistrationFailed) as failed:
        finish_training(run, trained["checkpoint"])
    message = str(failed.value)
    # Each try: the worker's process, then a fresh one; retried, then given up.
    assert len(calls) == 2 * (tasks.registration.RETRIES + 1)
    assert f"python -m flows.register_checkpoint --run-id {run.run_id}" in message
    assert "fake tensor" in message and trained["checkpoint"] in message
    assert "fake tensor" in client.get_run(run.run_id).data.tags[REGISTRATION_FAILED_TAG]
    assert Path(trained["checkpoint"]).is_file(), "the checkpoint is kept"
    assert not client.search_registered_models(filter_string=f"name = '{MODEL}'")

    # The command the message names: registers the checkpoint, for real this time.
    monkeypatch.undo()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", run.tracking_uri)
    version = register_checkpoint(run.run_id)
    registered = client.get_model_version(MODEL, version)
    assert registered.run_id == run.run_id
    assert registered.tags[CHECKPOINT_TAG] == trained["checkpoint"]
    assert len(registered.tags[MODEL_DIGEST_TAG]) == 64
    assert REGISTRATION_FAILED_TAG not in client.get_run(run.run_id).data.tags


def test_registering_a_run_that_is_no_training_names_it(trained):
    client, run = trained["client"], trained["run"]
    client.set_tag(run.run_id, WORKLOAD_TAG, "something-else")
    with pytest.raises(ValueError, match=rf"{run.run_id} has ddpflow.workload='something-else'"):
        register_checkpoint(run.run_id)


def test_an_export_that_fails_in_the_workers_process_is_done_in_a_fresh_one(trained, monkeypatch):
    """The fresh interpreter (a real `python -m ddpflow.workloads.registration`) registers
    what the worker's own process could not."""

    def export_fails(*args: object) -> str:
        raise RuntimeError(PLANTED)

    monkeypatch.setattr(tasks.registration, "register_from_checkpoint", export_fails)
    run, client = trained["run"], trained["client"]
    version = finish_training(run, trained["checkpoint"])
    registered = client.get_model_version(MODEL, version)
    assert registered.run_id == run.run_id
    assert registered.tags[CHECKPOINT_TAG] == trained["checkpoint"]
    # The fresh process tags the digest too: it runs the same registration code.
    with tempfile.TemporaryDirectory() as folder:
        stored = download_version(client, MODEL, version, folder)
        assert registered.tags[MODEL_DIGEST_TAG] == model_digest(stored)
    tags = client.get_run(run.run_id).data.tags
    assert REGISTRATION_FAILED_TAG not in tags
    # The failure the fresh process made up for is recorded with what else the process ran.
    seen = tags[IN_PROCESS_FAILURE_TAG]
    assert seen.startswith(PLANTED) and "(the process's other threads: " in seen, seen


LOADED = "ddpflow-charlm-loading"


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> Iterator[dict]:
    """One version registered by ddpflow's own path (export, log, tags) in this process; the
    tests that tamper with files register copies of it, never touch it."""
    folder = tmp_path_factory.mktemp("loading")
    tracking_uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(tracking_uri)
    location = default_artifact_location(tracking_uri, folder)
    run_id = client.create_run(client.create_experiment("loading", location)).info.run_id
    bias = torch.linspace(-1.0, 1.0, VOCAB_SIZE)  # distinct logits: a wrong load would show
    checkpoint = save_checkpoint(constant_model(bias), folder / "checkpoints")
    version = register_from_checkpoint("charlm", RunRef(tracking_uri, run_id), checkpoint, LOADED)
    yield {
        "client": client,
        "uri": tracking_uri,
        "run_id": run_id,
        "version": version,
        "checkpoint": checkpoint,
        "folder": folder,
    }


def pickle_payload(marker: Path) -> bytes:
    """A torch.save file that writes `marker` when it is unpickled."""

    class RunsCode:
        def __reduce__(self) -> tuple:
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    buffer = io.BytesIO()
    torch.save(RunsCode(), buffer)
    return buffer.getvalue()


def tamper_pt2(pt2: Path, marker: Path) -> None:
    """Rewrite a pt2 archive so its first weight is a pickle marked `use_pickle`: what
    `torch.export.load` unpickles with weights_only=False."""
    with zipfile.ZipFile(pt2) as archive:
        records = {info.filename: archive.read(info) for info in archive.infolist()}
    config_name = next(n for n in records if n.endswith("data/weights/model_weights_config.json"))
    config = json.loads(records[config_name])
    entry = next(iter(config["config"].values()))
    entry["use_pickle"] = True
    records[config_name] = json.dumps(config).encode()
    records[f"{config_name.rsplit('/', 1)[0]}/{entry['path_name']}"] = pickle_payload(marker)
    pt2.unlink()
    # torch's own archive writer (the reader wants its record alignment); it adds the
    # archive's top folder to each name itself.
    writer = torch._C.PyTorchFileWriter(str(pt2))
    for name, data in records.items():
        writer.write_record(name.split("/", 1)[1], data, len(data))
    writer.write_end_of_file()


def add_code_folder(files: Path, marker: Path) -> None:
    """Make the MLmodel name a code folder whose module writes `marker` when imported."""
    (files / "code").mkdir()
    (files / "code" / "json_helpers.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    mlmodel = files / "MLmodel"
    mlmodel.write_text(mlmodel.read_text().replace("    code: null\n", "    code: code\n"))
    assert "code: code" in mlmodel.read_text()


def register_tampered_copy(
    registered: dict, label: str, tamper: Callable[[Path, Path], None] | None = None
) -> tuple[str, Path, Path]:
    """A new version of the model whose files are the genuine ones with a code-running
    model.pt2 (or `tamper(files, marker)`'s change), logged to the run as someone with write
    access to MLflow could; (version, its files, the marker the payload writes)."""
    client, folder = registered["client"], registered["folder"]
    files = download_version(client, LOADED, registered["version"], str(folder / label))
    marker = folder / f"marker-{label}"
    if tamper is None:
        tamper_pt2(files / "data" / "model.pt2", marker)
    else:
        tamper(files, marker)
    client.log_artifacts(registered["run_id"], str(files), label)
    version = client.create_model_version(
        LOADED, f"runs:/{registered['run_id']}/{label}", run_id=registered["run_id"]
    ).version
    return str(version), files, marker


def test_a_version_registered_by_ddpflow_loads_with_pickle_refused(registered, monkeypatch):
    client, version = registered["client"], registered["version"]
    monkeypatch.setenv(PICKLE_SETTING, "true")  # the user's own setting comes back after
    with tempfile.TemporaryDirectory() as folder:
        stored = download_version(client, LOADED, version, folder)
        # The digest as docs/security.md says to reproduce it, with coreutils.
        shell = subprocess.run(
            "find . -type f -printf '%P\\0' | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum",
            shell=True,
            cwd=stored,
            capture_output=True,
            text=True,
            check=True,
        )
    tag = client.get_model_version(LOADED, version).tags[MODEL_DIGEST_TAG]
    assert tag == shell.stdout.split()[0]
    client.set_registered_model_alias(LOADED, CHAMPION_ALIAS, version)

    by_version = ddpflow.load_registered_model(registered["uri"], LOADED, version)
    by_alias = ddpflow.load_registered_model(registered["uri"], LOADED)  # the champion

    assert os.environ[PICKLE_SETTING] == "true"
    x = torch.randint(0, VOCAB_SIZE, (3, CONTEXT_LEN))
    expected, _ = load_model(registered["checkpoint"])[0](x)
    torch.testing.assert_close(by_version(x), expected)
    torch.testing.assert_close(by_alias(x), expected)


def test_a_tampered_model_pt2_that_would_run_code_never_runs(registered, monkeypatch):
    """The attacker also set the digest tag to the crafted files' digest: only pickle being
    refused stands in the way, even with the user's environment allowing pickle."""
    client = registered["client"]
    version, files, marker = register_tampered_copy(registered, "crafted")
    client.set_model_version_tag(LOADED, version, MODEL_DIGEST_TAG, model_digest(files))
    monkeypatch.setenv(PICKLE_SETTING, "true")

    with pytest.raises(RegistryError, match=r"not a pickle-free payload") as refused:
        ddpflow.load_registered_model(registered["uri"], LOADED, version)

    assert f"{LOADED!r} version {version}" in str(refused.value)
    assert not marker.exists(), "loading the crafted version ran its code"
    # The payload is live: MLflow's loader with pickle allowed does run it.
    with pytest.raises(Exception):  # noqa: B017 - the load fails after the code ran
        mlflow.pytorch.load_model(str(files))
    assert marker.read_text() == "ran"


def test_files_that_differ_from_their_digest_tag_are_refused_naming_the_version(registered):
    """Files changed after registration (the tag is the genuine one): refused by the digest,
    before MLflow reads anything; a version without the tag is refused too."""
    client = registered["client"]
    version, _, marker = register_tampered_copy(registered, "changed")
    genuine = client.get_model_version(LOADED, registered["version"]).tags[MODEL_DIGEST_TAG]
    client.set_model_version_tag(LOADED, version, MODEL_DIGEST_TAG, genuine)

    with pytest.raises(ModelDigestMismatch) as refused:
        ddpflow.load_registered_model(registered["uri"], LOADED, version)

    message = str(refused.value)
    assert f"registered model {LOADED!r} version {version}" in message
    assert MODEL_DIGEST_TAG in message and genuine in message
    assert "nothing was loaded" in message
    assert not marker.exists()

    client.delete_model_version_tag(LOADED, version, MODEL_DIGEST_TAG)
    with pytest.raises(ModelDigestMismatch, match=rf"version {version} has no tag"):
        ddpflow.load_registered_model(registered["uri"], LOADED, version)
    assert not marker.exists()


def test_a_version_that_names_a_code_folder_is_refused_before_mlflow_reads_it(registered):
    """MLflow would put the folder first on sys.path for good; ddpflow registers no code."""
    client = registered["client"]
    version, files, marker = register_tampered_copy(registered, "with-code", add_code_folder)
    client.set_model_version_tag(LOADED, version, MODEL_DIGEST_TAG, model_digest(files))
    path_before = list(sys.path)

    with pytest.raises(RegistryError, match=rf"version {version} carries code \('code'\)"):
        ddpflow.load_registered_model(registered["uri"], LOADED, version)

    assert sys.path == path_before
    assert not marker.exists()
