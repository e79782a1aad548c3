"""Per-rank batches: exact coverage per epoch, equal step counts, determinism."""

from collections import Counter

import pytest
import torch

from ddpflow.training.batching import epoch_batches, shard

CASES = [
    # (num_samples, batch_size, world_size)
    (1, 1, 1),
    (7, 3, 1),
    (10, 4, 1),
    (10, 3, 2),
    (9, 2, 4),  # tail of 1 < 4 ranks: folded into the previous batch
    (5, 1, 4),  # tail of 1 with one-sample batches
    (4, 1, 4),  # exactly one sample per rank
    (13, 5, 3),  # global batch 15 > N: a single short batch
    (100, 7, 3),
    (101, 8, 4),
    (99, 10, 4),  # tail of 19
    (83, 10, 4),  # tail of 3 < 4: folded
    (64, 16, 4),  # divides evenly
    (1000, 32, 2),
]


def all_batches(
    n: int, bs: int, ws: int, seed: int = 0, epoch: int = 0
) -> list[list[torch.Tensor]]:
    return [epoch_batches(n, bs, rank, ws, seed, epoch) for rank in range(ws)]


@pytest.mark.parametrize(("n", "bs", "ws"), CASES)
@pytest.mark.parametrize("epoch", [0, 3])
def test_every_sample_exactly_once_per_epoch(n: int, bs: int, ws: int, epoch: int) -> None:
    per_rank = all_batches(n, bs, ws, seed=11, epoch=epoch)
    seen = Counter(i for batches in per_rank for b in batches for i in b.tolist())
    assert sorted(seen) == list(range(n))
    assert set(seen.values()) == {1}


@pytest.mark.parametrize(("n", "bs", "ws"), CASES)
def test_every_rank_runs_the_same_number_of_non_empty_batches(n: int, bs: int, ws: int) -> None:
    per_rank = all_batches(n, bs, ws)
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1
    expected_steps = max(1, n // (bs * ws)) if n % (bs * ws) < ws else -(-n // (bs * ws))
    assert counts == {expected_steps}
    for batches in per_rank:
        for b in batches:
            assert b.numel() >= 1
            assert b.dtype == torch.int64
    # Full batches hold batch_size samples; only the (possibly folded) last one may differ.
    for batches in per_rank:
        for b in batches[:-1]:
            assert b.numel() == bs


def test_tiny_tail_is_folded_into_the_last_batch() -> None:
    # 83 = 2 * 40 + 3: the 3 leftovers cannot give each of 4 ranks a sample.
    per_rank = all_batches(83, 10, 4)
    assert [len(b) for b in per_rank] == [2, 2, 2, 2]
    last_sizes = [b[-1].numel() for b in per_rank]
    assert sum(last_sizes) == 43
    assert max(last_sizes) - min(last_sizes) <= 1


def test_same_seed_and_epoch_is_deterministic() -> None:
    for rank in range(3):
        a = epoch_batches(50, 4, rank, 3, seed=7, epoch=2)
        b = epoch_batches(50, 4, rank, 3, seed=7, epoch=2)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def flat(n: int, ws: int, seed: int, epoch: int) -> list[int]:
    return [i for b in epoch_batches(n, 4, 0, ws, seed, epoch) for i in b.tolist()]


def test_another_epoch_or_seed_gives_another_order() -> None:
    base = flat(200, 2, seed=7, epoch=0)
    assert flat(200, 2, seed=7, epoch=1) != base
    assert flat(200, 2, seed=8, epoch=0) != base
    # ... but still a permutation of the same rank-0 share size.
    assert len(flat(200, 2, seed=7, epoch=1)) == len(base)


def test_order_is_shuffled_not_sequential() -> None:
    assert flat(200, 1, seed=0, epoch=0) != list(range(200))


@pytest.mark.parametrize("bs", [0, -1])
def test_batch_size_below_one_is_rejected(bs: int) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        epoch_batches(10, bs, 0, 1, 0, 0)


def test_fewer_samples_than_ranks_is_rejected() -> None:
    with pytest.raises(ValueError, match="3 samples cannot be shared by 4 ranks"):
        epoch_batches(3, 1, 0, 4, 0, 0)


@pytest.mark.parametrize(("n", "ws"), [(1, 1), (10, 3), (11, 4), (8, 2)])
def test_shard_is_a_disjoint_cover(n: int, ws: int) -> None:
    shards = [shard(n, r, ws).tolist() for r in range(ws)]
    joined = sorted(i for s in shards for i in s)
    assert joined == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert shards[0][0] == 0
