"""Sweep flow parameters, their command line (JSON and bool options) and the champion rule."""

from __future__ import annotations

from typing import Any

import pytest

from flows.cli import parse_args
from flows.params import ParameterError, SweepParams, validate_params

VALID: dict[str, Any] = {
    "source": " /data/pets.json ",
    "grid": {"batch_size": [512, 2048], "lr": [0.001, 0.01]},
    "trials": None,
    "epochs": 2,
    "batch_size": 512,
    "lr": 0.005,
    "hidden_size": 32,
    "num_layers": 1,
    "dropout": 0.1,
    "seed": 0,
    "ranks_per_trial": 1,
    "holdout_fraction": 0.1,
    "keep_last": 1,
    "rank_timeout_s": 120.0,
    "model_name": "m",
    "experiment": "e",
    "promote": False,
}


def test_valid_sweep_parameters_pass() -> None:
    params = validate_params(SweepParams, dict(VALID))
    assert params.source == "/data/pets.json"
    assert params.grid == {"batch_size": [512, 2048], "lr": [0.001, 0.01]}


@pytest.mark.parametrize(
    ("field", "value"), [("ranks_per_trial", 0), ("lr", -1), ("epochs", 0), ("keep_last", 0)]
)
def test_bad_defaults_fail_the_sweep_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ParameterError, match=f"{field}={value!r}"):
        validate_params(SweepParams, {**VALID, field: value})


def test_unknown_parameter_is_rejected() -> None:
    with pytest.raises(ParameterError, match="world_size"):
        validate_params(SweepParams, {**VALID, "world_size": 2})


def _parse(*argv: str) -> dict[str, Any]:
    from flows.sweep_charlm import sweep_charlm

    return parse_args(sweep_charlm, list(argv))


def test_cli_parses_json_for_dict_and_list_parameters() -> None:
    assert _parse("--grid", '{"lr": [0.1, 0.2]}') == {"grid": {"lr": [0.1, 0.2]}}
    assert _parse("--trials", '[{"lr": 0.1}]') == {"trials": [{"lr": 0.1}]}
    with pytest.raises(SystemExit):  # argparse's own error: "not valid JSON"
        _parse("--grid", "{lr: 0.1}")


@pytest.mark.parametrize(("flag", "value"), [("--promote", True), ("--no-promote", False)])
def test_a_bool_is_a_switch_on_the_command_line(flag: str, value: bool) -> None:
    given = _parse(flag)
    assert validate_params(SweepParams, {**VALID, **given}).promote is value
    with pytest.raises(SystemExit):  # a switch takes no value
        _parse("--promote", "true")


def test_cli_passes_only_what_was_given_and_numbers_as_text_the_model_parses() -> None:
    given = _parse("--epochs", "2", "--lr", "0.5")
    assert given == {"epochs": "2", "lr": "0.5"}
    params = validate_params(SweepParams, given)
    assert (params.epochs, params.lr, params.batch_size) == (2, 0.5, SweepParams().batch_size)


def test_a_refused_value_with_braces_is_shown_as_given() -> None:
    # The explanation is a pydantic custom error without a context: shown as is, so a brace
    # in a value is neither doubled nor taken for a placeholder.
    with pytest.raises(ParameterError) as info:
        validate_params(SweepParams, {**VALID, "grid": '{"lr": [1]'})
    assert str(info.value).endswith("""grid='{"lr": [1]': Input should be a valid dictionary""")
