"""Per-rank batches by index slicing: no per-item Dataset/collate, no DataLoader processes."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    EpochOrder = Callable[[int, int], torch.Tensor]  # (seed, epoch) -> permutation

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
    global_batch: bool = False,
    order: EpochOrder | None = None,
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

    `global_batch`: batch_size is the whole group's batch per step, dealt out among the
    ranks (some take one sample more when it does not divide): the steps, and the samples
    of each, are then those of any world size. (step_sizes gives each step's total, for
    weighting each rank's loss by its share.)

    `order(seed, epoch)`: the epoch's permutation instead of a uniform one (a streamed
    split's shard windows, ddpflow.shards.order); it must not depend on the world size.
    """
    spans = _spans(num_samples, batch_size, world_size, start, global_batch)
    if not spans:
        return []
    perm = (order or partial(uniform_order, num_samples))(seed, epoch)[start:]
    return [perm[lo:hi][rank::world_size] for lo, hi in spans]


def uniform_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's permutation of range(num_samples) that epoch_batches deals by default."""
    import torch

    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    return torch.randperm(num_samples, generator=generator)


def check_global_batch_fits(batch_size: int, world_size: int) -> None:
    """A global batch must give each of `world_size` ranks a sample a step (fit, and the
    flows' parameters with their largest world size, check before any work)."""
    if batch_size < world_size:
        raise ValueError(
            f"global_batch with batch_size={batch_size} cannot give each of {world_size} "
            f"ranks a sample a step: raise batch_size to {world_size} or more"
        )


def step_sizes(
    num_samples: int, batch_size: int, world_size: int, start: int = 0, global_batch: bool = False
) -> list[int]:
    """The samples each step of epoch_batches (same arguments) takes over all ranks."""
    return [hi - lo for lo, hi in _spans(num_samples, batch_size, world_size, start, global_batch)]


def _spans(
    num_samples: int, batch_size: int, world_size: int, start: int, global_batch: bool
) -> list[tuple[int, int]]:
    """Each step's [lo, hi) in the epoch's permutation after `start`."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_samples < world_size:
        raise ValueError(
            f"{num_samples} samples cannot be shared by {world_size} ranks; use more data "
            "or a smaller world_size"
        )
    if global_batch:
        check_global_batch_fits(batch_size, world_size)
    left = max(0, num_samples - start)
    if left < world_size:
        return []
    step = batch_size if global_batch else batch_size * world_size
    num_steps = max(1, -(-left // step))
    if num_steps > 1 and left - (num_steps - 1) * step < world_size:
        num_steps -= 1
    bounds = [i * step for i in range(num_steps)] + [left]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def shard(num_samples: int, rank: int, world_size: int) -> torch.Tensor:
    """A fixed, disjoint slice of indices per rank (for evaluation, where order is irrelevant)."""
    import torch

    return torch.arange(rank, num_samples, world_size)
