"""The character LSTM of Saturn Cloud's pet-name tutorial, sizes configurable, loss in forward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.workloads.charlm.config import CharLSTMConfig, ModelConfigError


class CharLSTM(nn.Module):
    def __init__(self, config: CharLSTMConfig):
        super().__init__()
        self.config = config
        self.lstm = nn.LSTM(
            input_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            batch_first=True,
            # torch warns when dropout is set on a single layer (it would never apply).
            dropout=config.dropout if config.num_layers > 1 else 0.0,
        )
        self.fc = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [batch, time] symbol indices. Returns logits [batch, time, vocab] and the loss.

        Inputs stay compact integer indices until here; the one-hot encoding the
        tutorial stored for every sample is built per batch.
        """
        one_hot = F.one_hot(x.long(), num_classes=self.config.vocab_size).float()
        output, _ = self.lstm(one_hot)
        logits = self.fc(output)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.transpose(1, 2), targets.long())
        return logits, loss


def check_state_fits(config: CharLSTMConfig, model_state: Mapping[str, Any]) -> None:
    """The sizes `config` states are those of the checkpoint's own tensors, checked first.

    Those tensors are already in memory (a capped read), so a network built from a config
    that matches them is no larger: an in-range but inflated config (8192 units in 64 layers
    would be ~140 GB) fails here, naming the field, instead of allocating.
    """
    hidden, layers = config.hidden_size, config.num_layers
    expected = {
        "fc.weight": ("hidden_size", (config.vocab_size, hidden)),
        f"lstm.weight_hh_l{layers - 1}": ("num_layers", (4 * hidden, hidden)),
    }
    for name, (field, shape) in expected.items():
        tensor = model_state.get(name) if isinstance(model_state, Mapping) else None
        found = tuple(getattr(tensor, "shape", ())) if tensor is not None else None
        if found != shape:
            raise ModelConfigError(
                f"model_config.{field}={getattr(config, field)} does not match the "
                f"checkpoint's weights ({name} is {found or 'missing'}, expected {shape})"
            )
    if f"lstm.weight_hh_l{layers}" in model_state:
        raise ModelConfigError(
            f"model_config.num_layers={layers} does not match the checkpoint's weights "
            f"(it has a layer lstm.weight_hh_l{layers})"
        )
