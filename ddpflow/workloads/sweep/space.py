"""A search space over the trial fields: ranges (linear or log) and lists of choices.

The format, as JSON (the flow's `search` parameter):

    {"lr": {"low": 1e-4, "high": 1e-1, "log": true},
     "dropout": {"low": 0.0, "high": 0.5, "step": 0.1},
     "num_layers": {"low": 1, "high": 2},
     "hidden_size": {"choices": [16, 32, 64]}}

A key is a trial field of the workload (config.TrialFields); its value is either a range,
`low` and `high` (both included) with optional `log` (sample the logarithm uniformly;
low > 0) or `step`, or `choices`, a non-empty list. Every bound and every choice is held to
the field's own limits, as a trial's value is (`search.lr.low=-1: must be > 0`): a space
that could sample an invalid trial is refused whole, before any trial starts. Integer fields
sample integers; a true/false field takes choices only.

Nothing here samples: the flow's Optuna study does (its distributions mirror these). The grid
sampler needs every dimension discrete (`grid_points`): choices, integer ranges, and float
ranges with a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from ddpflow.workloads.sweep.config import (
    CHARLM_FIELDS,
    MAX_TRIALS,
    SweepConfigError,
    TrialFields,
    check_value,
    field_kind,
)

RANGE_KEYS = frozenset({"low", "high", "log", "step"})
EXAMPLE = '{"lr": {"low": 0.0001, "high": 0.1, "log": true}, "hidden_size": {"choices": [16, 32]}}'


@dataclass(frozen=True)
class Range:
    """Values from `low` to `high`, both included; `kind` is the field's int or float."""

    name: str
    kind: type
    low: float
    high: float
    log: bool = False
    step: float | None = None


@dataclass(frozen=True)
class Choices:
    name: str
    values: tuple[Any, ...]


Dimension = Range | Choices


@dataclass(frozen=True)
class SearchSpace:
    """The dimensions in the order given; the fields it leaves out come from the defaults."""

    dimensions: tuple[Dimension, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dimensions)

    def to_json(self) -> dict[str, Any]:
        """The space in the format it was given in (for the parent run's params)."""
        out: dict[str, Any] = {}
        for d in self.dimensions:
            if isinstance(d, Choices):
                out[d.name] = {"choices": list(d.values)}
            else:
                extra = {"log": True} if d.log else {}
                out[d.name] = {"low": d.low, "high": d.high, **extra}
                if d.step is not None:
                    out[d.name]["step"] = d.step
        return out


def parse_space(search: object, trial: TrialFields = CHARLM_FIELDS) -> SearchSpace:
    """The space of `search` over the workload's trial fields, or SweepConfigError naming
    every field that is wrong."""
    if not isinstance(search, Mapping) or not search:
        raise SweepConfigError(f"search={search!r}: must be a non-empty object, e.g. {EXAMPLE}")
    errors: list[str] = []
    dimensions: list[Dimension] = []
    for name, spec in search.items():
        if name not in trial.names:
            errors.append(f"search.{name}: unknown field; expected one of {', '.join(trial.names)}")
            continue
        dimension, problems = _dimension(str(name), spec, trial)
        errors += problems
        if dimension is not None:
            dimensions.append(dimension)
    if errors:
        raise SweepConfigError("; ".join(errors))
    return SearchSpace(tuple(dimensions))


def _dimension(name: str, spec: object, trial: TrialFields) -> tuple[Dimension | None, list[str]]:
    at = f"search.{name}"
    if not isinstance(spec, Mapping):
        how = '{"low": L, "high": H} (optional "log": true or "step": S) or {"choices": [...]}'
        return None, [f"{at}={spec!r}: must be {how}"]
    if "choices" in spec:
        extra = sorted(set(spec) - {"choices"})
        if extra:
            return None, [f"{at}: choices cannot be combined with {', '.join(extra)}"]
        return _choices(name, spec["choices"], trial)
    unknown = sorted(set(spec) - RANGE_KEYS)
    if unknown:
        return None, [f"{at}.{unknown[0]}: unknown key; use low, high, log, step or choices"]
    missing = [k for k in ("low", "high") if k not in spec]
    if missing:
        return None, [f"{at}.{missing[0]}: missing (a range needs low and high)"]
    if field_kind(name, trial) is bool:
        return None, [f'{at}: {name} is true or false; use {{"choices": [true, false]}}']
    return _range(name, spec, trial)


def _choices(name: str, values: object, trial: TrialFields) -> tuple[Dimension | None, list[str]]:
    at = f"search.{name}.choices"
    if not isinstance(values, list) or not values:
        return None, [f"{at}={values!r}: must be a non-empty list"]
    checked, errors = [], []
    for i, value in enumerate(values):
        converted, why = check_value(name, value, trial)
        if why is not None:
            errors.append(f"{at}[{i}]={value!r}: {why}")
        checked.append(converted)
    if errors:
        return None, errors
    if len(set(checked)) != len(checked):
        return None, [f"{at}={values!r}: has a value twice"]
    return Choices(name, tuple(checked)), []


def _range(
    name: str, spec: Mapping[str, Any], trial: TrialFields
) -> tuple[Dimension | None, list[str]]:
    at = f"search.{name}"
    kind = field_kind(name, trial)
    bounds: dict[str, Any] = {}
    errors = []
    for key in ("low", "high"):
        bounds[key], why = check_value(name, spec[key], trial)
        if why is not None:
            errors.append(f"{at}.{key}={spec[key]!r}: {why}")
    log, step = spec.get("log", False), spec.get("step")
    if not isinstance(log, bool):
        errors.append(f"{at}.log={log!r}: must be true or false")
    if step is not None:
        numeric = isinstance(step, int | float) and not isinstance(step, bool)
        if not numeric or not math.isfinite(step) or step <= 0:
            errors.append(f"{at}.step={step!r}: must be a number > 0")
        elif kind is int and not float(step).is_integer():
            errors.append(f"{at}.step={step!r}: must be an integer ({name} is one)")
        elif log:
            errors.append(f"{at}: log and step cannot be combined")
    if errors:
        return None, errors
    low, high = bounds["low"], bounds["high"]
    if low >= high:
        return None, [f"{at}: low={spec['low']!r} must be below high={spec['high']!r}"]
    if log and low <= 0:
        return None, [f"{at}.low={spec['low']!r}: must be > 0 with log"]
    return Range(name, kind, low, high, bool(log), None if step is None else kind(step)), []


def grid_points(dimension: Dimension) -> tuple[Any, ...] | None:
    """The values the grid sampler visits on `dimension`: its choices, or its range's values
    from low by step up to high (an integer range steps by 1 unless told); None for a float
    range without a step, which has no grid. A float step's values are computed in decimal,
    as Optuna's own stepped distribution rounds its high, so every point lies in it."""
    if isinstance(dimension, Choices):
        return dimension.values
    if dimension.kind is not int and dimension.step is None:
        return None
    low, step = Decimal(str(dimension.low)), Decimal(str(dimension.step or 1))
    count = int((Decimal(str(dimension.high)) - low) // step) + 1
    if count > MAX_TRIALS:  # before listing them: a seed range could hold 10^19
        raise SweepConfigError(
            f"search.{dimension.name}: {count} grid points; the grid has at most {MAX_TRIALS}"
        )
    kind = dimension.kind
    return tuple(kind(low + i * step) for i in range(count))


def grid_of(space: SearchSpace) -> dict[str, list[Any]]:
    """Each dimension's grid points, for Optuna's GridSampler, or SweepConfigError naming
    every continuous range (and the fix) and a grid too large to run."""
    points = {d.name: grid_points(d) for d in space.dimensions}
    continuous = [name for name, values in points.items() if values is None]
    if continuous:
        raise SweepConfigError(
            "; ".join(
                f"search.{name}: a continuous range has no grid points; give it a "
                f'"step" (e.g. {{"low": L, "high": H, "step": S}}) or "choices", '
                "or use sampler tpe or random"
                for name in continuous
            )
        )
    grid = {name: list(values or ()) for name, values in points.items()}
    if math.prod(len(v) for v in grid.values()) > MAX_TRIALS:
        raise SweepConfigError(f"search: the grid has more than {MAX_TRIALS} points")
    return grid


def grid_size(space: SearchSpace) -> int:
    """How many points the grid sampler visits (every one once)."""
    return math.prod(len(v) for v in grid_of(space).values())


def epochs_range(space: SearchSpace, default_epochs: int) -> tuple[int, int]:
    """The fewest and the most epochs a trial of the space trains (`default_epochs` where
    the space leaves epochs out): the pruners' largest resource, a budget's smallest spend."""
    for d in space.dimensions:
        if d.name == "epochs":
            if isinstance(d, Range):
                return int(d.low), int(d.high)
            return min(int(v) for v in d.values), max(int(v) for v in d.values)
    return default_epochs, default_epochs
