"""The image flow's parameters are validated up front, naming the field and the value."""

from __future__ import annotations

from typing import Any

import pytest

from flows.params import ImageParams, ParameterError, validate_params

VALID: dict[str, Any] = {
    "source": None,
    "arch": "resnet18",
    "weights": "none",
    "freeze_backbone": False,
    "image_size": 32,
    "resize": "crop",
    "val_fraction": 0.2,
    "epochs": 3,
    "batch_size": 32,
    "lr": 0.001,
    "optimizer": "adam",
    "lr_patience": 2,
    "world_size": None,
    "seed": 0,
    "max_bad_fraction": 0.01,
    "keep_last": 3,
    "rank_timeout_s": 120.0,
    "model_name": "m",
    "experiment": "e",
}


def test_defaults_pass_and_strings_are_stripped() -> None:
    params = validate_params(ImageParams, {**VALID, "source": " s3://b/images ", "weights": " x "})
    assert params.source == "s3://b/images" and params.weights == "x"
    assert validate_params(ImageParams, VALID).source is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("arch", "vgg16"),
        ("optimizer", "rmsprop"),
        ("resize", "pad"),
        ("image_size", 4),
        ("val_fraction", 1.0),
        ("max_bad_fraction", 1.0),
        ("max_bad_fraction", -0.1),
        ("source", "   "),
        ("weights", ""),
        ("world_size", 0),
        ("precision", "half"),
        ("channels_last", "maybe"),
        ("pin_memory", 2),
    ],
)
def test_bad_values_name_the_field_and_value(field: str, value: Any) -> None:
    shown = "''" if field == "source" else repr(value)  # source is stripped before the check
    with pytest.raises(ParameterError, match=rf"{field}={shown}"):
        validate_params(ImageParams, {**VALID, field: value})
