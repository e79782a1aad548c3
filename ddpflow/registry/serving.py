"""What a registered model serves, and its registration: one path for every workload.

A workload's model returns (logits, loss); MLflow serves `forward(x) -> logits`. Each
version is registered from a checkpoint and tagged with it (ddpflow.registry.read), because that
checkpoint, not the registered code, is what champion/challenger scoring loads; and with the
digest of its files, which `ddpflow.registry.load.load_registered_model` checks before it
deserialises anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from ddpflow.registry.load import pickle_refused, tag_model_digest
from ddpflow.registry.read import tag_checkpoint
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import register_pt2_model


class LogitsOnly(nn.Module):
    """forward(x) -> logits of a model whose forward returns (logits, loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[0]


def register_checkpoint_model(
    run: RunRef,
    model: nn.Module,
    example: np.ndarray,
    registered_name: str,
    checkpoint_uri: str,
    quiet_warnings: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Register `model` (loaded from `checkpoint_uri`) as a new version serving logits for
    inputs like `example`, tag the version with its checkpoint and the digest of its files;
    the version number."""
    # log_model loads the model it just saved, to check that `example` can be served. With
    # pickle refused that load is the one ddpflow's loader does: an export it would refuse
    # shows at registration (MLflow's warning "Failed to validate serving input example"),
    # not first when someone loads the version.
    with pickle_refused():
        version = register_pt2_model(
            run, LogitsOnly(model).eval(), example, registered_name, quiet_warnings
        )
    client = MlflowClient(run.tracking_uri)
    tag_checkpoint(client, registered_name, version, checkpoint_uri)
    tag_model_digest(client, registered_name, version)
    return version
