"""The character LSTM of Saturn Cloud's pet-name tutorial, sizes configurable, loss in forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.workloads.charlm.config import CharLSTMConfig


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
