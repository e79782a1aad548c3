"""A training whose registration fails keeps its run and checkpoint, and says how to
register it later; `python -m flows.register_checkpoint`'s flow then registers it. The export
runs for real in a fresh process (ddpflow.workloads.registration); the planted failure
replaces only that call, on a real Prefect API (prefect_harness) and a SQLite MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect import flow

import tasks.registration
from ddpflow.checkpoint.store import LATEST_CHECKPOINT_TAG
from ddpflow.registry.read import CHECKPOINT_TAG
from ddpflow.tracking.inspection import WORKLOAD_TAG
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import default_artifact_location
from ddpflow.workloads.charlm.vocab import VOCAB_SIZE
from flows.register_checkpoint import register_checkpoint
from tasks.registration import (
    IN_PROCESS_FAILURE_TAG,
    REGISTRATION_FAILED_TAG,
    RegistrationFailed,
    register_trained,
)
from tests.unit.champion_helpers import constant_model, save_checkpoint

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
    tags = client.get_run(run.run_id).data.tags
    assert REGISTRATION_FAILED_TAG not in tags
    # The failure the fresh process made up for is recorded with what else the process ran.
    seen = tags[IN_PROCESS_FAILURE_TAG]
    assert seen.startswith(PLANTED) and "(the process's other threads: " in seen, seen
