"""A sweep's search space: its format, and a refusal that names the field and the bound."""

from __future__ import annotations

from typing import Any

import pytest

from ddpflow.workloads.sweep.config import SweepConfigError
from ddpflow.workloads.sweep.space import Choices, Range, SearchSpace, parse_space


def test_ranges_log_ranges_steps_and_choices_are_parsed_with_the_fields_types() -> None:
    space = parse_space(
        {
            "lr": {"low": 1e-4, "high": 1e-1, "log": True},
            "dropout": {"low": 0, "high": 0.5, "step": 0.1},
            "num_layers": {"low": 1, "high": 2},
            "hidden_size": {"choices": [16, 32, 64]},
        }
    )
    assert space.names == ("lr", "dropout", "num_layers", "hidden_size")
    lr, dropout, layers, hidden = space.dimensions
    assert lr == Range("lr", float, 1e-4, 1e-1, log=True)
    assert dropout == Range("dropout", float, 0.0, 0.5, step=0.1)
    assert layers == Range("num_layers", int, 1, 2)
    assert hidden == Choices("hidden_size", (16, 32, 64))


def test_the_space_round_trips_to_its_json() -> None:
    given = {"lr": {"low": 0.001, "high": 0.1, "log": True}, "seed": {"choices": [1, 2]}}
    assert parse_space(given).to_json() == given


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ({"lr": {"low": -1, "high": 0.1}}, "search.lr.low=-1: must be > 0"),
        ({"lr": {"low": 0.1, "high": 11}}, "search.lr.high=11: must be <= 10"),
        ({"num_layers": {"low": 1, "high": 2.5}}, "search.num_layers.high=2.5: must be an integer"),
        ({"hidden_size": {"choices": [16, 0]}}, "search.hidden_size.choices[1]=0: must be between"),
        ({"hidden_size": {"choices": []}}, "search.hidden_size.choices=[]: must be a non-empty"),
        ({"dropout": {"choices": [0.1, True]}}, "search.dropout.choices[1]=True: must be a number"),
        ({"lrr": {"low": 1, "high": 2}}, "search.lrr: unknown field; expected one of batch_size"),
        ({"lr": 0.01}, 'search.lr=0.01: must be {"low": L, "high": H}'),
        ({"lr": {"low": 0.1}}, "search.lr.high: missing"),
        ({"lr": {"low": 0.1, "high": 0.01}}, "search.lr: low=0.1 must be below high=0.01"),
        ({"lr": {"low": 0.1, "high": 0.2, "lg": True}}, "search.lr.lg: unknown key"),
        ({"dropout": {"low": 0, "high": 0.5, "log": True}}, "search.dropout.low=0: must be > 0"),
        ({"lr": {"low": 0.1, "high": 0.2, "log": "yes"}}, "search.lr.log='yes': must be true"),
        ({"epochs": {"low": 1, "high": 4, "step": 1.5}}, "search.epochs.step=1.5: must be an int"),
        ({"lr": {"choices": [0.1], "low": 0.1}}, "search.lr: choices cannot be combined with low"),
        ({}, "search={}: must be a non-empty object"),
    ],
)
def test_an_invalid_space_is_refused_naming_the_field(search: Any, message: str) -> None:
    with pytest.raises(SweepConfigError) as refused:
        parse_space(search)
    assert message in str(refused.value)


def test_every_problem_is_named_not_only_the_first() -> None:
    with pytest.raises(SweepConfigError) as refused:
        parse_space({"lr": {"low": -1, "high": 0.1}, "batch_size": {"choices": [0]}})
    assert "search.lr.low=-1" in str(refused.value)
    assert "search.batch_size.choices[0]=0" in str(refused.value)


def test_a_space_is_a_value() -> None:
    assert parse_space({"seed": {"choices": [1]}}) == SearchSpace((Choices("seed", (1,)),))
