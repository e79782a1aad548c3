"""The character LSTM of Saturn Cloud's pet-name tutorial, sizes configurable, loss in forward."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.charlm.vocab import VOCAB_SIZE


@dataclass(frozen=True)
class CharLSTMConfig:
    """Defaults are the tutorial's: 31 symbols, 128 hidden units, 4 layers, dropout 0.1."""

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 128
    num_layers: int = 4
    dropout: float = 0.1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CharLSTMConfig:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


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
