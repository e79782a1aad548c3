"""Flow parameters are validated up front and every error names the field and the value."""

from typing import Any

import pytest

from flows.params import CharLMParams, ParameterError, validate_params

VALID: dict[str, Any] = {
    "source": "  /data/pets.json ",
    "epochs": 3,
    "batch_size": 64,
    "lr": 0.003,
    "hidden_size": 128,
    "num_layers": 4,
    "dropout": 0.1,
    "world_size": None,
    "seed": 0,
    "holdout_fraction": 0.1,
    "keep_last": 3,
    "num_names": 20,
    "rank_timeout_s": 600.0,
    "model_name": "charlm",
    "experiment": "ddpflow-charlm",
}


def test_valid_parameters_pass() -> None:
    params = validate_params(CharLMParams, dict(VALID))
    assert isinstance(params, CharLMParams)
    assert params.source == "/data/pets.json"  # stripped
    assert params.epochs == 3 and params.lr == pytest.approx(0.003)
    assert params.world_size is None


def test_world_size_is_optional_and_checked() -> None:
    values = {k: v for k, v in VALID.items() if k != "world_size"}
    assert validate_params(CharLMParams, values).world_size is None
    assert validate_params(CharLMParams, {**VALID, "world_size": 2}).world_size == 2


def test_parameters_are_frozen() -> None:
    params = validate_params(CharLMParams, dict(VALID))
    with pytest.raises(Exception, match="(?i)frozen"):
        params.epochs = 5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epochs", 0),
        ("lr", -1),
        ("lr", 0),
        ("batch_size", 0),
        ("holdout_fraction", 1.5),
        ("holdout_fraction", 0.0),
        ("dropout", 1.0),
        ("world_size", 0),
        ("keep_last", 0),
        ("checkpoint_every_steps", -1),
        ("checkpoint_every_steps", 2.5),
        ("checkpoint_every_s", -1.0),
        ("seed", -1),
        ("num_layers", 65),
        ("epochs", "many"),
        ("source", "   "),
        ("precision", "fp8"),
        ("pin_memory", "maybe"),
        ("compile", "sometimes"),
    ],
)
def test_bad_value_names_field_and_value(field: str, value: Any) -> None:
    with pytest.raises(ParameterError) as info:
        validate_params(CharLMParams, {**VALID, field: value})
    message = str(info.value)
    assert message.startswith("invalid flow parameters: ")
    shown = "''" if field == "source" else repr(value)  # source is stripped before the check
    assert f"{field}={shown}" in message
    # Only the bad field is reported.
    assert message.count("=") == 1


def test_unknown_key_is_named() -> None:
    with pytest.raises(ParameterError) as info:
        validate_params(CharLMParams, {**VALID, "epoch": 5})
    message = str(info.value)
    assert "epoch=5" in message
    assert "Extra inputs are not permitted" in message


def test_several_problems_are_all_reported() -> None:
    with pytest.raises(ParameterError) as info:
        validate_params(CharLMParams, {**VALID, "epochs": 0, "lr": -1})
    message = str(info.value)
    assert "epochs=0" in message and "lr=-1" in message


def test_a_field_left_out_takes_its_default_and_errors_echo_no_secret() -> None:
    values = {k: v for k, v in VALID.items() if k != "epochs"}
    assert validate_params(CharLMParams, values).epochs == CharLMParams().epochs == 3
    values["source"] = "https://user:hunter2@example.com/pets.json"
    with pytest.raises(ParameterError) as info:
        validate_params(CharLMParams, {**values, "lr": 0})
    message = str(info.value)
    assert "source=" in message and "lr=0" in message
    assert "hunter2" not in message


def test_parameter_error_is_a_value_error_without_pydantic_context() -> None:
    with pytest.raises(ParameterError) as info:
        validate_params(CharLMParams, {**VALID, "epochs": 0})
    assert isinstance(info.value, ValueError)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_speed_settings_default_to_auto_and_take_cli_text() -> None:
    params = validate_params(CharLMParams, dict(VALID))
    assert (params.precision, params.pin_memory, params.compile) == ("auto", "auto", False)
    text = validate_params(CharLMParams, {**VALID, "pin_memory": "False", "precision": "bf16"})
    assert (text.pin_memory, text.precision) == (False, "bf16")
    fix = "Input should be 'auto', 'fp32', 'bf16' or 'fp16'"
    with pytest.raises(ParameterError, match=rf"precision='fp8': {fix}$"):
        validate_params(CharLMParams, {**VALID, "precision": "fp8"})


# docs/configuration.md: step checkpoints default to every 600 s and no step count, the same
# in every training flow that offers them and in the validated parameters.
def test_checkpoint_interval_defaults_agree_with_the_flows() -> None:
    import inspect

    from ddpflow.checkpoint.steps import DEFAULT_CHECKPOINT_EVERY_S
    from flows.retrain_charlm import retrain_charlm
    from flows.train_charlm import train_charlm
    from flows.train_images import train_images

    params = validate_params(CharLMParams, dict(VALID))
    assert (params.checkpoint_every_steps, params.checkpoint_every_s) == (0, 600.0)
    assert DEFAULT_CHECKPOINT_EVERY_S == 600.0
    for flow in (train_charlm, retrain_charlm, train_images):
        [parameter] = inspect.signature(flow.fn).parameters.values()
        for name in ("checkpoint_every_steps", "checkpoint_every_s"):
            assert getattr(parameter.default, name) == getattr(params, name), (flow, name)


def test_a_nan_checkpoint_interval_is_refused_with_the_fix() -> None:
    with pytest.raises(ParameterError, match=r"checkpoint_every_s=nan: .*a finite number$"):
        validate_params(CharLMParams, {**VALID, "checkpoint_every_s": float("nan")})
