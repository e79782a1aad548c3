"""A search space over the trial fields: ranges (linear or log) and lists of choices.

The format, as JSON (the flow's `search` parameter):

    {"lr": {"low": 1e-4, "high": 1e-1, "log": true},
     "dropout": {"low": 0.0, "high": 0.5, "step": 0.1},
     "num_layers": {"low": 1, "high": 2},
     "hidden_size": {"choices": [16, 32, 64]}}

A key is a trial field (config.TRIAL_FIELDS); its value is either a range, `low` and `high`
(both included) with optional `log` (sample the logarithm uniformly; low > 0) or `step`, or
`choices`, a non-empty list. Every bound and every choice is held to the field's own limits,
as a trial's value is (`search.lr.low=-1: must be > 0`): a space that could sample an invalid
trial is refused whole, before any trial starts. Integer fields sample integers.

Nothing here samples: the flow's Optuna study does (its distributions mirror these).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddpflow.workloads.sweep.config import (
    TRIAL_FIELDS,
    SweepConfigError,
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


def parse_space(search: object) -> SearchSpace:
    """The space of `search`, or SweepConfigError naming every field that is wrong."""
    if not isinstance(search, Mapping) or not search:
        raise SweepConfigError(f"search={search!r}: must be a non-empty object, e.g. {EXAMPLE}")
    errors: list[str] = []
    dimensions: list[Dimension] = []
    for name, spec in search.items():
        if name not in TRIAL_FIELDS:
            errors.append(
                f"search.{name}: unknown field; expected one of {', '.join(TRIAL_FIELDS)}"
            )
            continue
        dimension, problems = _dimension(str(name), spec)
        errors += problems
        if dimension is not None:
            dimensions.append(dimension)
    if errors:
        raise SweepConfigError("; ".join(errors))
    return SearchSpace(tuple(dimensions))


def _dimension(name: str, spec: object) -> tuple[Dimension | None, list[str]]:
    at = f"search.{name}"
    if not isinstance(spec, Mapping):
        how = '{"low": L, "high": H} (optional "log": true or "step": S) or {"choices": [...]}'
        return None, [f"{at}={spec!r}: must be {how}"]
    if "choices" in spec:
        extra = sorted(set(spec) - {"choices"})
        if extra:
            return None, [f"{at}: choices cannot be combined with {', '.join(extra)}"]
        return _choices(name, spec["choices"])
    unknown = sorted(set(spec) - RANGE_KEYS)
    if unknown:
        return None, [f"{at}.{unknown[0]}: unknown key; use low, high, log, step or choices"]
    missing = [k for k in ("low", "high") if k not in spec]
    if missing:
        return None, [f"{at}.{missing[0]}: missing (a range needs low and high)"]
    return _range(name, spec)


def _choices(name: str, values: object) -> tuple[Dimension | None, list[str]]:
    at = f"search.{name}.choices"
    if not isinstance(values, list) or not values:
        return None, [f"{at}={values!r}: must be a non-empty list"]
    checked, errors = [], []
    for i, value in enumerate(values):
        converted, why = check_value(name, value)
        if why is not None:
            errors.append(f"{at}[{i}]={value!r}: {why}")
        checked.append(converted)
    if errors:
        return None, errors
    if len(set(checked)) != len(checked):
        return None, [f"{at}={values!r}: has a value twice"]
    return Choices(name, tuple(checked)), []


def _range(name: str, spec: Mapping[str, Any]) -> tuple[Dimension | None, list[str]]:
    at = f"search.{name}"
    kind = field_kind(name)
    bounds: dict[str, Any] = {}
    errors = []
    for key in ("low", "high"):
        bounds[key], why = check_value(name, spec[key])
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
