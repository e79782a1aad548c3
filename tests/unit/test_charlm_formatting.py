"""format_names must reproduce the pet-name tutorial's format_training_data, just cheaper."""

import random

import pytest
import torch

from ddpflow.workloads.charlm.corpus import load_names
from ddpflow.workloads.charlm.formatting import format_names, one_hot, split_xy
from ddpflow.workloads.charlm.vocab import CHARACTERS, CONTEXT_LEN, VOCAB_SIZE, decode

SEED_CHARACTERS = list("*+abcdefghijklmnopqrstuvwxyz-. ")
EDGE_NAMES = [
    "a",
    "abcdefgh",
    "abcdefghi",
    "abcdefghijklmnopqrstuvwxyz",
    "mr. whiskers",
    "jean-luc",
    "st. bernard the third",
    "b.b. king",
    "x y",
    "zz",
]


def seed_reference(pet_names: list[str]) -> list[list[int]]:
    """The tutorial's format_training_data, kept as literal as possible, minus tensors/one-hot."""
    characters = SEED_CHARACTERS
    str_len = 8

    def get_substrings(in_str: str) -> list[str]:
        in_str = in_str + "+"
        return [in_str[0:j] for j in range(1, len(in_str) + 1)]

    expanded = [get_substrings(name) for name in pet_names]
    expanded = [item for sublist in expanded for item in sublist]
    as_chars = [list(name) for name in expanded]
    padded = [name[-(str_len + 1) :] for name in as_chars]
    padded = [list((str_len + 1 - len(chars)) * "*") + chars for chars in padded]
    return [[characters.index(char) for char in name] for name in padded]


def seed_xy(pet_names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    numeric = seed_reference(pet_names)
    y = torch.tensor([name[1:] for name in numeric])
    x = torch.tensor([name[:-1] for name in numeric])
    return torch.nn.functional.one_hot(x, num_classes=len(SEED_CHARACTERS)).float(), y


@pytest.fixture(scope="module")
def sample_names() -> list[str]:
    names, _ = load_names()
    return random.Random(0).sample(names, 500) + EDGE_NAMES


def test_vocabulary_matches_seed() -> None:
    assert list(CHARACTERS) == SEED_CHARACTERS
    assert VOCAB_SIZE == 31 and CONTEXT_LEN == 8


def test_windows_equal_seed_reference(sample_names: list[str]) -> None:
    windows = format_names(sample_names)
    assert windows.tolist() == seed_reference(sample_names)


@pytest.mark.parametrize("name", EDGE_NAMES)
def test_edge_names_individually(name: str) -> None:
    windows = format_names([name])
    assert windows.shape == (len(name) + 1, CONTEXT_LEN + 1)
    assert windows.tolist() == seed_reference([name])


def test_split_xy_and_one_hot_equal_seed_tensors(sample_names: list[str]) -> None:
    x_idx, y = split_xy(format_names(sample_names))
    seed_x, seed_y = seed_xy(sample_names)
    assert x_idx.dtype == torch.int64 and y.dtype == torch.int64
    assert torch.equal(y, seed_y)
    x = one_hot(x_idx)
    assert x.dtype == torch.float32 and x.shape == seed_x.shape
    assert torch.equal(x, seed_x)


def test_long_name_keeps_only_last_nine_characters() -> None:
    name = "abcdefghijklmnopqrstuvwxyz abcdefghijklm"
    assert len(name) == 40
    rows = [decode(row) for row in format_names([name])]
    assert len(rows) == 41
    assert rows[0] == "********a"
    assert rows[8] == "abcdefghi"
    assert rows[9] == "bcdefghij"
    assert rows[-2] == name[-9:]
    assert rows[-1] == name[-8:] + "+"
    assert all(len(row) == 9 for row in rows)


def test_order_is_name_by_name_prefix_by_prefix() -> None:
    rows = [decode(row) for row in format_names(["ab", "c"])]
    assert rows == ["********a", "*******ab", "******ab+", "********c", "*******c+"]


def test_dtype_and_bytes_per_sample(sample_names: list[str]) -> None:
    windows = format_names(sample_names)
    assert windows.dtype == torch.uint8
    assert windows.is_contiguous()
    assert windows.element_size() * windows.shape[1] == 9
    assert windows.nbytes == 9 * windows.shape[0]


def test_empty_inputs() -> None:
    assert format_names([]).shape == (0, CONTEXT_LEN + 1)
    # The tutorial turns an empty name into the single window "********+"; so do we.
    assert [decode(r) for r in format_names([""])] == ["********+"]


@pytest.mark.parametrize("bad", ["Bella", "zoë", "a+b", "a*b", "r2d2", "tab\there"])
def test_unnormalised_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match=r"name 1 .*not normalised"):
        format_names(["ok", bad])
