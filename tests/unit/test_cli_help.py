"""A flow's `--help`: options grouped in the order a user decides them, switches for bools."""

from __future__ import annotations

import importlib

import pytest

from flows.cli import HELP_GROUPS, help_group, parse_args
from flows.param_docs import parameter

FLOWS = ("train_charlm", "train_images", "retrain_charlm", "sweep_charlm", "sweep_images",
         "scaling_charlm", "scaling_images")  # fmt: skip


def _flow(name: str):
    return getattr(importlib.import_module(f"flows.{name}"), name)


@pytest.mark.parametrize("name", FLOWS)
def test_every_option_has_its_place_and_help_lists_them_group_by_group(name, capsys) -> None:
    flow = _flow(name)
    fields = parameter(flow)[2]
    assert [f for f in fields if help_group(f) == "other"] == [], "add them to HELP_GROUPS"
    with pytest.raises(SystemExit):
        parse_args(flow, ["--help"])
    text = capsys.readouterr().out
    shown = [title for title in HELP_GROUPS if f"\n{title}:\n" in text]
    assert shown == [t for t in HELP_GROUPS if any(help_group(f) == t for f in fields)]
    # Each group's options come after the previous group's.
    positions = {f: text.index(f"  --{f.replace('_', '-')}") for f in fields}
    by_group = [max(positions[f] for f in fields if help_group(f) == t) for t in shown]
    firsts = [min(positions[f] for f in fields if help_group(f) == t) for t in shown]
    assert all(last < first for last, first in zip(by_group, firsts[1:], strict=False))
    for field, schema in fields.items():
        if schema.get("type") == "boolean":
            option = field.replace("_", "-")
            assert f"--{option}, --no-{option}" in text, field


def test_the_data_options_come_before_the_model_and_the_training_ones(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(_flow("train_charlm"), ["--help"])
    text = capsys.readouterr().out
    positions = [text.index(option) for option in ("--source", "--hidden-size", "--epochs",
                                                    "--world-size", "--experiment")]  # fmt: skip
    assert positions == sorted(positions), positions
    assert "default: --no-compile" in text
