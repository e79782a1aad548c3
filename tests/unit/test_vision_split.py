"""The stratified split: deterministic, proportional per class, stable under dropped files."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ddpflow.workloads.vision.split import num_held_out, stratified_split

COUNTS = {0: 100, 1: 37, 2: 10, 3: 2, 4: 1}
KEYS = [f"{c}/{i:03d}.png" for c, n in COUNTS.items() for i in range(n)]
LABELS = [int(k.split("/")[0]) for k in KEYS]


def test_same_seed_same_split_other_seed_other_split() -> None:
    first = stratified_split(KEYS, LABELS, 0.2, seed=3)
    assert stratified_split(KEYS, LABELS, 0.2, seed=3) == first
    assert stratified_split(KEYS, LABELS, 0.2, seed=4) != first


def test_each_class_is_held_out_in_proportion() -> None:
    train, val = stratified_split(KEYS, LABELS, 0.2, seed=0)
    assert sorted(train + val) == list(range(len(KEYS))) and not set(train) & set(val)
    held = Counter(LABELS[i] for i in val)
    assert held == {0: 20, 1: 7, 2: 2, 3: 1}, "a single-sample class is trained only"
    assert all(num_held_out(n, 0.2) == held.get(c, 0) for c, n in COUNTS.items())


def test_split_of_a_file_does_not_depend_on_order_or_other_files() -> None:
    _, val = stratified_split(KEYS, LABELS, 0.2, seed=0)
    val_keys = {KEYS[i] for i in val}
    order = list(range(len(KEYS)))
    random.Random(1).shuffle(order)
    keys, labels = [KEYS[i] for i in order], [LABELS[i] for i in order]
    _, shuffled_val = stratified_split(keys, labels, 0.2, seed=0)
    assert {keys[i] for i in shuffled_val} == val_keys


@pytest.mark.parametrize(("n", "expected"), [(1, 0), (2, 1), (3, 1), (10, 2), (5, 1)])
def test_every_class_with_two_samples_is_on_both_sides(n: int, expected: int) -> None:
    assert num_held_out(n, 0.2) == expected
    assert num_held_out(n, 0.99) == max(0, n - 1)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_fraction_outside_zero_one_is_rejected(fraction: float) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        stratified_split(KEYS, LABELS, fraction, seed=0)
