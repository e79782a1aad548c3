"""The character LSTM's sizes, free of torch: the flow process builds them from its
parameters and starts without torch (ddpflow.workloads.charlm.model builds the network from
them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ddpflow.param_types import MAX_HIDDEN_SIZE, MAX_NUM_LAYERS
from ddpflow.workloads.charlm.vocab import VOCAB_SIZE


class ModelConfigError(ValueError):
    """A `model_config` read back (from a checkpoint) that no ddpflow training wrote."""


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
    def from_dict(cls, data: Any) -> CharLSTMConfig:
        """The config a checkpoint states, each size checked before anything is allocated.

        A checkpoint is data from outside (a registry tag or a user names it): a
        hidden_size of 10**9 would try to allocate 10**19 weights. ModelConfigError names
        the field; the ranges are the flows' parameter bounds.
        """
        if not isinstance(data, dict):
            raise ModelConfigError(f"model_config is a {type(data).__name__}, not a dict")
        config = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        _check_int("vocab_size", config.vocab_size, VOCAB_SIZE, VOCAB_SIZE)
        _check_int("hidden_size", config.hidden_size, 1, MAX_HIDDEN_SIZE)
        _check_int("num_layers", config.num_layers, 1, MAX_NUM_LAYERS)
        dropout = config.dropout
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, int | float)
            or not 0 <= dropout < 1
        ):
            raise ModelConfigError(f"model_config.dropout={dropout!r:.40} is not in [0, 1)")
        return config


def _check_int(field: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        allowed = f"{low}" if low == high else f"an integer from {low} to {high}"
        raise ModelConfigError(f"model_config.{field}={value!r:.40} is not {allowed}")
