"""Registered pet-name versions of known quality, for the champion/challenger tests.

A model whose output layer has zero weights predicts the same distribution (softmax of its
bias) at every position, whatever its LSTM computes: its holdout loss is known exactly
without training, and its size (and so its scoring time) can be chosen freely.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from ddpflow import storage
from ddpflow.checkpoint.store import LATEST_CHECKPOINT_TAG, CheckpointStore, build_state
from ddpflow.registry.read import tag_checkpoint
from ddpflow.tracking.run import default_artifact_location
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.workloads.charlm.formatting import format_names, split_xy
from ddpflow.workloads.charlm.model import CharLSTM
from ddpflow.workloads.charlm.vocab import VOCAB_SIZE


def write_holdout(folder: Path, num_names: int = 600) -> str:
    names = [n.lower() for n in json.loads(DEFAULT_CORPUS_PATH.read_text())[:num_names]]
    uri = str(folder / "val.pt")
    storage.save_torch(uri, {"windows": format_names(names)})
    return uri


def unigram_bias(val_uri: str) -> torch.Tensor:
    """Log-frequencies of the holdout's next characters: the best constant prediction."""
    _, y = split_xy(storage.load_torch(val_uri)["windows"])
    counts = torch.bincount(y.flatten(), minlength=VOCAB_SIZE).float() + 1.0
    return counts.log()


def peaked_bias() -> torch.Tensor:
    """Almost all probability on one rare symbol: a bad model."""
    bias = torch.zeros(VOCAB_SIZE)
    bias[VOCAB_SIZE - 1] = 8.0
    return bias


def expected_loss(bias: torch.Tensor, val_uri: str) -> float:
    _, y = split_xy(storage.load_torch(val_uri)["windows"])
    return float(-F.log_softmax(bias, dim=0)[y].mean())


def constant_model(bias: torch.Tensor, hidden_size: int = 8, num_layers: int = 1) -> CharLSTM:
    model = CharLSTM(CharLSTMConfig(hidden_size=hidden_size, num_layers=num_layers, dropout=0))
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.copy_(bias)
    return model


def save_checkpoint(model: CharLSTM, folder: Path) -> str:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = build_state(model, optimizer, epoch=1, model_config=model.config.to_dict())
    return CheckpointStore(str(folder)).save(state)


def start_checkpointed_run(client: MlflowClient, model: CharLSTM, folder: Path) -> str:
    """A run that trained `model`: its checkpoint and the run tag training writes. Its
    experiment keeps its artifacts in `folder`, as the flows' SQLite stores do: MLflow's own
    default is ./mlruns in the working directory, the checkout."""
    experiment = client.get_experiment_by_name("champion-tests")
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment(
            "champion-tests",
            artifact_location=default_artifact_location(client.tracking_uri, folder),
        )
    )
    run_id = client.create_run(experiment_id).info.run_id
    uri = save_checkpoint(model, folder / run_id)
    client.set_tag(run_id, LATEST_CHECKPOINT_TAG, uri)
    return run_id


def add_version(client: MlflowClient, name: str, model: CharLSTM, folder: Path) -> tuple[str, str]:
    """(version, run id) of a new version of `name` made from `model`'s checkpoint.

    The version's own files are never read by ddpflow, so none are logged here.
    """
    run_id = start_checkpointed_run(client, model, folder)
    checkpoint = client.get_run(run_id).data.tags[LATEST_CHECKPOINT_TAG]
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name)
    version = client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id).version
    tag_checkpoint(client, name, str(version), checkpoint)
    return str(version), run_id
