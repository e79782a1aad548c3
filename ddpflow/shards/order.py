"""An epoch's sample order over shards: random enough to train on, local enough to stream.

A uniform permutation (what the in-memory path draws) would have every batch touch almost
every shard, so a rank would need the whole dataset at hand. This order shuffles the shards,
cuts the shuffled list into windows of `window` shards and shuffles the samples inside each
window: consecutive batches read from `window` shards at a time, and each shard is read
once per epoch. The shards themselves mix the classes (formatting orders the files by a
hash of their names), so a window is a fair sample of the dataset.

The order depends on (seed, epoch) and the shard sizes only, never on the world size or the
rank: ddpflow.training.batching deals it out to the ranks as it deals the uniform one, so
each sample is seen once per epoch on any world size, and a resume on fewer ranks goes on
with the same remaining samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddpflow.training.batching import SEED_STRIDE


def window_order(shard_counts: Sequence[int], window: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of range(sum(shard_counts)) (int64): shards shuffled, then samples
    shuffled within each run of `window` consecutive shards of that order."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1 shard")
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    counts = torch.tensor(list(shard_counts), dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    shard_order = torch.randperm(len(counts), generator=generator)
    pieces = []
    for lo in range(0, len(shard_order), window):
        members = shard_order[lo : lo + window]
        span = torch.cat(
            [torch.arange(int(starts[s]), int(starts[s] + counts[s])) for s in members]
        )
        pieces.append(span[torch.randperm(len(span), generator=generator)])
    if not pieces:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat(pieces)
