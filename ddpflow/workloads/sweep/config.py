"""Trial configs of a sweep: grid expansion and per-trial validation that names the field.

Each workload has its trial config, the fields a trial may set: `TrialConfig` (the pet-name
model's) and `ImageTrialConfig` (the image classifier's). `TrialFields` reads a config's
field types and bounds; every function here takes the workload's (the pet-name one unless
told). An invalid trial does not stop the sweep: it is reported (``trials[3].lr=-1: must
be > 0``) and never launched, while the valid trials run.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, get_args, get_type_hints

from pydantic.fields import FieldInfo

from ddpflow.param_types import (
    BOUNDS,
    BatchSize,
    Dropout,
    Epochs,
    HiddenSize,
    LearningRate,
    NumLayers,
    Seed,
    bounds_of,
)

MAX_TRIALS = 1000  # a typo like 10 values x 10 keys should fail loudly, not queue 10^10 trials


class SweepConfigError(ValueError):
    """The sweep as a whole is unusable (not one trial): the message names the input."""


@dataclass(frozen=True)
class TrialConfig:
    """One model to train: the fields a trial may set (the rest come from the sweep)."""

    # The flows' parameter types (ddpflow.param_types): a trial is held to the same bounds
    # as the sweep's own defaults and a lone training.
    batch_size: BatchSize
    lr: LearningRate
    hidden_size: HiddenSize
    num_layers: NumLayers
    dropout: Dropout
    epochs: Epochs
    seed: Seed

    def label(self) -> str:
        return f"bs={self.batch_size} lr={self.lr:g} h={self.hidden_size}x{self.num_layers}"


@dataclass(frozen=True)
class ImageTrialConfig:
    """One image classifier to train (flows.sweep_images): the fields a trial may set."""

    batch_size: BatchSize
    lr: LearningRate
    freeze_backbone: bool  # train only the new classifier head
    augment: bool  # random crop and flip of the training images
    epochs: Epochs
    seed: Seed

    def label(self) -> str:
        extra = ("frozen " if self.freeze_backbone else "") + ("aug" if self.augment else "")
        return f"bs={self.batch_size} lr={self.lr:g} {extra}".rstrip()


Check = tuple[Callable[[Any], bool], str]
_TESTS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def _check(info: FieldInfo) -> Check:
    """One Field's bounds as a test and its message ("must be between 1 and 64")."""
    bounds = bounds_of(info)
    if bounds.keys() == {"ge", "le"}:
        message = f"must be between {bounds['ge']} and {bounds['le']}"
    else:
        message = "must be " + " and ".join(f"{BOUNDS[k]} {b}" for k, b in bounds.items())
    return (lambda v: all(_TESTS[k](v, b) for k, b in bounds.items())), message


def _rules(config: type) -> dict[str, tuple[type, list[Check]]]:
    """Per trial field: its Python type and the checks its annotated type declares."""
    rules = {}
    for name, hint in get_type_hints(config, include_extras=True).items():
        args = get_args(hint)  # a plain `bool` has no Annotated metadata
        kind, metadata = (args[0], args[1:]) if args else (hint, ())
        checks = [_check(m) for m in metadata if isinstance(m, FieldInfo) and bounds_of(m)]
        rules[name] = (kind, checks)
    return rules


@dataclass(frozen=True)
class TrialFields:
    """One workload's trial fields: its config class, their names in order, their rules."""

    config: type
    names: tuple[str, ...]
    rules: Mapping[str, tuple[type, list[Check]]]

    @classmethod
    def of(cls, config: type) -> TrialFields:
        return cls(config, tuple(f.name for f in fields(config)), _rules(config))


CHARLM_FIELDS = TrialFields.of(TrialConfig)
IMAGE_FIELDS = TrialFields.of(ImageTrialConfig)
TRIAL_FIELDS = CHARLM_FIELDS.names


@dataclass(frozen=True)
class TrialSpec:
    """A trial as given (`values`, defaults filled in) and, when valid, its config."""

    index: int
    values: dict[str, Any]
    config: TrialConfig | ImageTrialConfig | None  # the workload's, when valid
    errors: tuple[str, ...] = ()
    field_names: tuple[str, ...] = TRIAL_FIELDS  # the workload's trial fields, in order

    @property
    def valid(self) -> bool:
        return self.config is not None

    @property
    def name(self) -> str:
        return f"trial-{self.index}"


def field_kind(name: str, trial: TrialFields = CHARLM_FIELDS) -> type:
    """The Python type of trial field `name` (int, float or bool)."""
    return trial.rules[name][0]


def check_value(
    name: str, value: Any, trial: TrialFields = CHARLM_FIELDS
) -> tuple[Any, str | None]:
    """`value` as trial field `name` takes it, converted, or None and why ("must be > 0")."""
    kind, checks = trial.rules[name]
    if kind is bool:  # a switch: 1 or "yes" are mistakes, not true
        return (value, None) if isinstance(value, bool) else (None, "must be true or false")
    # bool is an int to Python, but `"lr": true` is a mistake, not a learning rate of 1.
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if not numeric or (kind is int and not float(value).is_integer()):
        return None, "must be an integer" if kind is int else "must be a number"
    converted = kind(value)
    if kind is float and not math.isfinite(converted):
        return None, "must be a finite number"
    for ok, message in checks:
        if not ok(converted):
            return None, message
    return converted, None


def _check_field(prefix: str, name: str, value: Any, trial: TrialFields) -> tuple[Any, str | None]:
    converted, why = check_value(name, value, trial)
    # Messages quote the value as given (lr=-1), not as converted (lr=-1.0).
    return converted, None if why is None else f"{prefix}.{name}={value!r}: {why}"


def validate_trial(
    index: int, values: Mapping[str, Any], trial: TrialFields = CHARLM_FIELDS
) -> TrialSpec:
    """Check every field of one trial; all problems are reported, not just the first."""
    prefix = f"trials[{index}]"
    errors = [
        f"{prefix}.{k}: unknown field; expected one of {', '.join(trial.names)}"
        for k in values
        if k not in trial.names
    ]
    checked: dict[str, Any] = {}
    for name in trial.names:
        value = values.get(name)
        if value is None:
            errors.append(f"{prefix}.{name}: missing")
            continue
        checked[name], error = _check_field(prefix, name, value, trial)
        if error:
            errors.append(error)
    config = None if errors else trial.config(**checked)
    return TrialSpec(index, dict(values), config, tuple(errors), trial.names)


def expand_grid(
    grid: Mapping[str, Any], trial: TrialFields = CHARLM_FIELDS
) -> list[dict[str, Any]]:
    """The cartesian product of the grid's lists, first key varying slowest.

    A scalar value is a list of one. Unknown keys and empty lists fail the whole sweep:
    they are mistakes in the grid, not in one trial.
    """
    unknown = sorted(set(grid) - set(trial.names))
    if unknown:
        raise SweepConfigError(
            f"grid keys {unknown} are not trial fields; use {', '.join(trial.names)}"
        )
    axes = {k: v if isinstance(v, list | tuple) else [v] for k, v in grid.items()}
    empty = [k for k, v in axes.items() if not v]
    if empty:
        raise SweepConfigError(f"grid.{empty[0]} is an empty list; give at least one value")
    if math.prod(len(v) for v in axes.values()) > MAX_TRIALS:
        raise SweepConfigError(f"the grid expands to more than {MAX_TRIALS} trials")
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def build_trials(
    grid: Mapping[str, Any] | None,
    trials: Sequence[Mapping[str, Any]] | None,
    defaults: Mapping[str, Any],
    trial: TrialFields = CHARLM_FIELDS,
) -> list[TrialSpec]:
    """Trials from a grid or an explicit list, each completed with `defaults` and checked."""
    if (grid is None) == (trials is None):
        raise SweepConfigError(
            'pass exactly one of grid= (e.g. {"batch_size": [512, 2048], "lr": [0.001, '
            '0.01]}) or trials= (e.g. [{"lr": 0.001}, {"lr": 0.01}])'
        )
    overrides = expand_grid(grid, trial) if grid is not None else list(trials or [])
    if not overrides:
        raise SweepConfigError("trials= is an empty list; give at least one trial")
    if len(overrides) > MAX_TRIALS:
        raise SweepConfigError(f"{len(overrides)} trials given; at most {MAX_TRIALS}")
    specs = []
    for index, override in enumerate(overrides):
        if not isinstance(override, Mapping):
            error = f"trials[{index}]={override!r}: must be an object of trial fields"
            specs.append(TrialSpec(index, {}, None, (error,), trial.names))
            continue
        specs.append(validate_trial(index, {**defaults, **override}, trial))
    return specs
