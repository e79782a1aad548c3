"""Per-rank batches by index slicing: no per-item Dataset/collate, no DataLoader processes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch.Generator.manual_seed takes at most 2**64 - 1, and each epoch's order is seeded with
# seed * SEED_STRIDE + epoch: MAX_SEED is the largest seed that fits for every epoch up to
# MAX_EPOCHS (the flows' limit). Every other use of `seed` (dropout, sampling, the image
# split) accepts anything this small.
SEED_STRIDE = 1_000_003
MAX_EPOCHS = 10_000
MAX_SEED = (2**64 - 1 - MAX_EPOCHS) // SEED_STRIDE


def epoch_batches(
    num_samples: int,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    epoch: int,
    start: int = 0,
) -> list[torch.Tensor]:
    """Index batches of one rank for one epoch.

    Every rank draws the same permutation (seeded by seed and epoch), cuts it into global
    batches of batch_size * world_size and takes every world_size-th index of each, so
    across ranks each sample is seen exactly once per epoch, and every rank runs the same
    number of steps (DDP needs that: an extra step on one rank would wait forever for the
    others' gradients). A tail too small to give each rank a sample is folded into the
    previous batch, so the last batch may be a little larger than batch_size.

    `start` skips that many samples of the permutation (a resume inside the epoch): with
    the same world size and start = steps done * batch_size * world_size, the batches are
    exactly the epoch's remaining ones. Nothing left to share among the ranks gives [].
    """
    import torch  # lazy: the flow process imports this module and starts without torch

    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_samples < world_size:
        raise ValueError(
            f"{num_samples} samples cannot be shared by {world_size} ranks; use more data "
            "or a smaller world_size"
        )
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    perm = torch.randperm(num_samples, generator=generator)
    if start:
        perm, num_samples = perm[start:], max(0, num_samples - start)
        if num_samples < world_size:
            return []
    global_batch = batch_size * world_size
    num_steps = max(1, -(-num_samples // global_batch))
    if num_steps > 1 and num_samples - (num_steps - 1) * global_batch < world_size:
        num_steps -= 1
    bounds = [i * global_batch for i in range(num_steps)] + [num_samples]
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    return [perm[lo:hi][rank::world_size] for lo, hi in spans]


def shard(num_samples: int, rank: int, world_size: int) -> torch.Tensor:
    """A fixed, disjoint slice of indices per rank (for evaluation, where order is irrelevant)."""
    import torch

    return torch.arange(rank, num_samples, world_size)
