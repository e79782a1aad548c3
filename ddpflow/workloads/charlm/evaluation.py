"""Held-out evaluation, name generation and model registration for the pet-name model (on a
worker: it needs torch; what it found is a charlm.report.EvalResult)."""

from __future__ import annotations

import json

import numpy as np
import torch
from mlflow.tracking import MlflowClient

from ddpflow import storage
from ddpflow.checkpoint.store import CheckpointStore
from ddpflow.distributed.context import RankContext
from ddpflow.registry.serving import register_checkpoint_model
from ddpflow.tracking.loggers import RunRef
from ddpflow.training.validation import evaluate_loss
from ddpflow.workloads.charlm.config import CharLSTMConfig, ModelConfigError
from ddpflow.workloads.charlm.corpus import MAX_SOURCE_BYTES
from ddpflow.workloads.charlm.data import open_windows
from ddpflow.workloads.charlm.model import CharLSTM, check_state_fits
from ddpflow.workloads.charlm.report import EvalResult
from ddpflow.workloads.charlm.sampling import generate_names
from ddpflow.workloads.charlm.vocab import CONTEXT_LEN

SINGLE = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="none")


def load_model(checkpoint_uri: str) -> tuple[CharLSTM, int]:
    """The char LSTM of a checkpoint; its sizes are checked before the network is built."""
    state = CheckpointStore(checkpoint_uri.rsplit("/", 1)[0]).load(checkpoint_uri)
    try:
        config = CharLSTMConfig.from_dict(state["model_config"])
        check_state_fits(config, state["model_state"])
    except ModelConfigError as error:
        raise ModelConfigError(
            f"{checkpoint_uri}: {error}; pass a checkpoint written by ddpflow's char-LM training"
        ) from None
    model = CharLSTM(config)
    model.load_state_dict(state["model_state"])
    return model.eval(), int(state["epoch"])


def evaluate_checkpoint(
    checkpoint_uri: str, val_uri: str, train_names_uri: str, num_names: int, seed: int
) -> EvalResult:
    """Validation loss on the holdout and names sampled with the tutorial's rule (see sampling)."""
    torch.set_num_threads(1)  # runs on a 1-thread Dask worker next to other work
    model, epoch = load_model(checkpoint_uri)
    val = open_windows(val_uri)
    val_loss = evaluate_loss(model, val, SINGLE, batch_size=8192)
    names = generate_names(model, num_names, seed=seed)
    # The training names re-encoded as JSON: within twice the source's cap.
    known = set(json.loads(storage.read_bytes(train_names_uri, 2 * MAX_SOURCE_BYTES)))
    novel = sum(1 for n in names if n and n not in known) / max(1, len(names))
    return EvalResult(val_loss, names, novel, checkpoint_uri, epoch)


def log_evaluation(run: RunRef, result: EvalResult) -> None:
    client = MlflowClient(run.tracking_uri)
    client.log_metric(run.run_id, "final_val_loss", result.val_loss, step=result.epoch)
    client.log_metric(run.run_id, "novel_name_fraction", result.novel_fraction, step=result.epoch)
    client.log_text(run.run_id, "\n".join(result.names) + "\n", "evaluation/generated_names.txt")


def register_model(run: RunRef, checkpoint_uri: str, registered_name: str) -> str:
    """Register the checkpoint's model; it serves symbol indices [N, 8] -> logits.

    The version is tagged with its checkpoint: that is what the champion/challenger step
    scores, so it never has to load (and run) what the registry holds.
    """
    model, _ = load_model(checkpoint_uri)
    return register_checkpoint_model(
        run,
        model,
        np.zeros((2, CONTEXT_LEN), dtype=np.int64),
        registered_name,
        checkpoint_uri,
        # torch.export notes that nn.LSTM re-assigns its flat weights; harmless for serving.
        quiet_warnings=[{"message": ".*were assigned during export.*"}],
    )
