"""Sweep trial configs: grid expansion and per-trial validation that names the field."""

from __future__ import annotations

from typing import Any

import pytest

from ddpflow.workloads.sweep.config import (
    MAX_TRIALS,
    SweepConfigError,
    TrialConfig,
    build_trials,
    expand_grid,
    validate_trial,
)

DEFAULTS: dict[str, Any] = {
    "epochs": 2,
    "batch_size": 512,
    "lr": 0.005,
    "hidden_size": 32,
    "num_layers": 1,
    "dropout": 0.1,
    "seed": 0,
}


def test_grid_is_the_cartesian_product_first_key_slowest() -> None:
    combos = expand_grid({"batch_size": [512, 2048], "lr": [0.001, 0.01, 0.1]})
    assert len(combos) == 6
    assert combos[0] == {"batch_size": 512, "lr": 0.001}
    assert combos[2] == {"batch_size": 512, "lr": 0.1}
    assert combos[3] == {"batch_size": 2048, "lr": 0.001}


def test_grid_scalar_is_a_list_of_one() -> None:
    assert expand_grid({"lr": [0.1, 0.2], "epochs": 3}) == [
        {"lr": 0.1, "epochs": 3},
        {"lr": 0.2, "epochs": 3},
    ]


@pytest.mark.parametrize(
    ("grid", "expected"),
    [
        ({"bacth_size": [1]}, "bacth_size"),
        ({"lr": []}, "grid.lr is an empty list"),
        ({"lr": list(range(1, 40)), "seed": list(range(40))}, f"more than {MAX_TRIALS}"),
    ],
)
def test_bad_grid_fails_the_whole_sweep(grid: dict, expected: str) -> None:
    with pytest.raises(SweepConfigError, match=expected):
        expand_grid(grid)


def test_trials_fill_defaults_and_keep_their_index() -> None:
    specs = build_trials(None, [{"lr": 0.01}, {"batch_size": 2048, "hidden_size": 16}], DEFAULTS)
    assert [s.index for s in specs] == [0, 1]
    assert specs[0].config == TrialConfig(512, 0.01, 32, 1, 0.1, 2, 0)
    assert specs[1].config.batch_size == 2048 and specs[1].config.hidden_size == 16
    assert specs[1].config.lr == 0.005  # the default
    assert all(s.valid and not s.errors for s in specs)


def test_grid_trials_are_validated_too() -> None:
    specs = build_trials({"lr": [0.01, -1]}, None, DEFAULTS)
    assert specs[0].valid
    assert not specs[1].valid
    assert specs[1].errors == ("trials[1].lr=-1: must be > 0",)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"lr": -1}, "trials[3].lr=-1: must be > 0"),
        ({"lr": 0}, "trials[3].lr=0: must be > 0"),
        ({"lr": 11}, "trials[3].lr=11: must be <= 10"),
        ({"lr": float("nan")}, "trials[3].lr=nan: must be a finite number"),
        ({"lr": "fast"}, "trials[3].lr='fast': must be a number"),
        ({"lr": True}, "trials[3].lr=True: must be a number"),
        ({"batch_size": 0}, "trials[3].batch_size=0: must be >= 1"),
        ({"batch_size": 2.5}, "trials[3].batch_size=2.5: must be an integer"),
        ({"hidden_size": 0}, "trials[3].hidden_size=0: must be between 1 and 8192"),
        ({"num_layers": 65}, "trials[3].num_layers=65: must be between 1 and 64"),
        ({"dropout": 1}, "trials[3].dropout=1: must be >= 0 and < 1"),
        ({"epochs": 0}, "trials[3].epochs=0: must be between 1 and 10000"),
        ({"seed": -2}, "trials[3].seed=-2: must be >= 0"),
        ({"bacth_size": 3}, "trials[3].bacth_size: unknown field"),
    ],
)
def test_invalid_trial_names_the_field_and_value(override: dict, message: str) -> None:
    spec = validate_trial(3, {**DEFAULTS, **override})
    assert not spec.valid and spec.config is None
    assert any(e.startswith(message) for e in spec.errors), spec.errors


def test_every_problem_is_reported_not_just_the_first() -> None:
    spec = validate_trial(0, {**DEFAULTS, "lr": -1, "batch_size": 0})
    assert len(spec.errors) == 2


def test_missing_field_is_named() -> None:
    values = {k: v for k, v in DEFAULTS.items() if k != "seed"}
    assert validate_trial(1, values).errors == ("trials[1].seed: missing",)


def test_integral_float_is_accepted_as_int() -> None:
    spec = validate_trial(0, {**DEFAULTS, "batch_size": 1024.0})
    assert spec.config.batch_size == 1024 and isinstance(spec.config.batch_size, int)


def test_a_trial_that_is_not_an_object_is_invalid_alone() -> None:
    specs = build_trials(None, [{"lr": 0.01}, 5], DEFAULTS)
    assert specs[0].valid
    assert specs[1].errors == ("trials[1]=5: must be an object of trial fields",)


@pytest.mark.parametrize(
    ("grid", "trials"), [(None, None), ({"lr": [0.1]}, [{"lr": 0.1}]), (None, [])]
)
def test_exactly_one_non_empty_source_of_trials(grid, trials) -> None:
    with pytest.raises(SweepConfigError, match="grid|trials"):
        build_trials(grid, trials, DEFAULTS)


def test_fault_injection_is_not_a_trial_field() -> None:
    """Crashing a trial on purpose is the tests' business (tests/helpers/trial_faults.py),
    not something a user can set in a trial."""
    spec = validate_trial(0, {**DEFAULTS, "epochs": 3, "fail_after_epochs": 1})
    assert spec.config is None
    assert spec.errors[0].startswith("trials[0].fail_after_epochs: unknown field")


def test_label_names_the_swept_values() -> None:
    assert TrialConfig(2048, 0.01, 32, 1, 0.0, 2, 0).label() == "bs=2048 lr=0.01 h=32x1"


IMAGE_DEFAULTS: dict[str, Any] = {
    "batch_size": 32,
    "lr": 0.001,
    "freeze_backbone": False,
    "augment": False,
    "epochs": 2,
    "seed": 0,
}


def test_an_image_sweeps_trials_take_the_image_fields() -> None:
    from ddpflow.workloads.sweep.config import IMAGE_FIELDS, ImageTrialConfig

    grid = {"lr": [0.01, 0.001], "freeze_backbone": [True, False]}
    specs = build_trials(grid, None, IMAGE_DEFAULTS, IMAGE_FIELDS)
    assert [s.valid for s in specs] == [True] * 4
    assert specs[0].config == ImageTrialConfig(32, 0.01, True, False, 2, 0)
    assert specs[0].config.label() == "bs=32 lr=0.01 frozen"
    assert specs[0].field_names == IMAGE_FIELDS.names


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # A switch is true or false: 1 or "yes" are mistakes, not true.
        ({"freeze_backbone": 1}, "trials[0].freeze_backbone=1: must be true or false"),
        ({"augment": "yes"}, "trials[0].augment='yes': must be true or false"),
        ({"lr": True}, "trials[0].lr=True: must be a number"),
        ({"hidden_size": 32}, "trials[0].hidden_size: unknown field; expected one of batch_size"),
    ],
)
def test_an_invalid_image_trial_names_the_field(override: dict, message: str) -> None:
    from ddpflow.workloads.sweep.config import IMAGE_FIELDS

    (spec,) = build_trials(None, [override], IMAGE_DEFAULTS, IMAGE_FIELDS)
    assert not spec.valid
    assert any(message in e for e in spec.errors), spec.errors


def test_an_image_search_takes_a_switch_as_choices_only() -> None:
    from ddpflow.workloads.sweep.config import IMAGE_FIELDS
    from ddpflow.workloads.sweep.space import Choices, parse_space

    space = parse_space({"freeze_backbone": {"choices": [True, False]}}, IMAGE_FIELDS)
    assert space.dimensions == (Choices("freeze_backbone", (True, False)),)
    with pytest.raises(
        SweepConfigError, match=r'search.augment: augment is true or false; use \{"choices"'
    ):
        parse_space({"augment": {"low": 0, "high": 1}}, IMAGE_FIELDS)
    with pytest.raises(SweepConfigError, match="search.hidden_size: unknown field"):
        parse_space({"hidden_size": {"choices": [16]}}, IMAGE_FIELDS)
