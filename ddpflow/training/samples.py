"""What fit() trains and validates on: a number of samples and the batch of chosen ones.

fit() picks sample indices (each rank its part of an epoch's order, ddpflow.training.batching) and
asks the data for their batch; it never sees how samples are stored. Anything with
`__len__` and `batch(index) -> (inputs, targets)` will do: the image workload's splits
(uint8 images and labels), or rows of one tensor made into a batch (`TensorSamples`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

Batch = tuple[torch.Tensor, torch.Tensor]
ToBatch = Callable[[torch.Tensor], Batch]


class Samples(Protocol):
    def __len__(self) -> int: ...

    def batch(self, index: torch.Tensor) -> Batch:
        """(inputs, targets) of the samples at `index` (a 1-D int64 tensor), on the CPU."""
        ...


class StreamedSamples(Samples, Protocol):
    """Samples that want to know the epoch ahead. Each method is optional, and fit() uses
    the ones the data has: it draws the epoch's order from `epoch_order` (else a uniform
    permutation), and announces the rank's batches with `start_epoch` before asking for them
    in that order (a streamed split reads its shards ahead, ddpflow.shards.stream;
    augmentation seeds itself with the epoch)."""

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """A permutation of range(len(self)) that depends on (seed, epoch) only."""
        ...

    def start_epoch(self, epoch: int, batches: list[torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class TensorSamples:
    """The rows of one tensor, made into (inputs, targets) by `to_batch` (e.g. the pet-name
    model's uint8 windows into one-hot inputs and next-character targets)."""

    data: torch.Tensor
    to_batch: ToBatch

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, index: torch.Tensor) -> Batch:
        return self.to_batch(self.data[index])


@dataclass(frozen=True)
class TensorPairs:
    """Inputs and targets as two tensors of the same length (row i of each is sample i)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.targets):
            raise ValueError(
                f"TensorPairs got {len(self.inputs)} inputs but {len(self.targets)} targets: "
                "pass one target per input row"
            )

    def __len__(self) -> int:
        return len(self.inputs)

    def batch(self, index: torch.Tensor) -> Batch:
        return self.inputs[index], self.targets[index]
