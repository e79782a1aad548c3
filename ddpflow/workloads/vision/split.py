"""A deterministic, stratified train/validation split of an image folder's samples."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence


def num_held_out(num_samples: int, val_fraction: float) -> int:
    """How many of a class's samples go to validation.

    A class with two or more samples has at least one on each side, so every class is both
    trained and measured; a class with one sample is trained only.
    """
    if num_samples < 2:
        return 0
    return min(max(round(num_samples * val_fraction), 1), num_samples - 1)


def stratified_split(
    keys: Sequence[str], labels: Sequence[int], val_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """(train indices, validation indices), each sorted, per class in proportion.

    Within a class, samples are ordered by a seeded hash of their key rather than by a
    shuffled position, so the split of a file does not depend on the listing order or on
    which other files (a corrupt one, say) were dropped; the same seed gives the same split.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if len(keys) != len(labels):
        raise ValueError(f"{len(keys)} keys but {len(labels)} labels")
    by_class: dict[int, list[int]] = defaultdict(list)
    for i, label in enumerate(labels):
        by_class[label].append(i)
    train: list[int] = []
    val: list[int] = []
    for members in by_class.values():
        members.sort(key=lambda i: _rank(seed, keys[i]))
        cut = num_held_out(len(members), val_fraction)
        val.extend(members[:cut])
        train.extend(members[cut:])
    return sorted(train), sorted(val)


def _rank(seed: int, key: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{key}".encode()).digest()
