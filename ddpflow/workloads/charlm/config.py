"""The character LSTM's sizes, free of torch: the flow process builds them from its
parameters and starts without torch (ddpflow.workloads.charlm.model builds the network from
them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ddpflow.workloads.charlm.vocab import VOCAB_SIZE


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
