"""A flow whose parameters are built from their declaration instead of written out again.

A flow function takes its validated parameters as one object:

    @flow(FlowParameters(TRAIN_CHARLM, (CharLMParams,)), name="train-charlm", ...)
    def train_charlm(params: CharLMParams) -> CharLMSummary: ...

and the decorator gives Prefect a function whose signature has one parameter per entry of
the flow's defaults (flows.defaults), typed and described by the pydantic field that
declares it (flows.params). So Prefect's parameter schema (a deployment's form, with each
parameter's help), `prefect deployment run --param k=v`, the command line (flows.cli) and
the generated parameter tables (flows.param_docs) all read the same declaration.

The signature's types are the fields' types without their bounds and with a Literal
widened to str: Prefect casts a value to them (JSON or command-line text) and the
declaring model then checks it with messages that name the field, the value and the fix
(flows.params.FIXES). Bounds in the schema would have Prefect's server refuse a bad
`--param` with its own message first; the bounds are in each parameter's help instead.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from prefect.utilities.hashing import file_hash
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ddpflow.param_types import BOUNDS, bounds_of
from flows.params import validate_params
from flows.redacted_flow import RedactedParamsFlow
from flows.redacted_flow import flow as redacted_flow

R = TypeVar("R")


@dataclass(frozen=True)
class FlowParameters:
    """A flow's parameters: `defaults` names them, in order, with their defaults; `models`
    declare each one's type, bounds and help and check them.

    With one model the flow function gets that model; with several, a tuple with one
    instance per model, in order: each model but the last takes the fields it declares,
    and the last the rest plus `fixed` (values the flow sets itself, not parameters). No
    callable lives here: a flow run's context, this included, is pickled to the Dask
    scheduler, which cannot import a flow module loaded by Prefect from its file path."""

    defaults: Mapping[str, Any]
    models: tuple[type[BaseModel], ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    fields: dict[str, FieldInfo] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fields = {}
        for name in self.defaults:
            declared = [m.model_fields[name] for m in self.models if name in m.model_fields]
            if not declared:
                raise TypeError(f"flow parameter {name!r} is not declared by {self.models}")
            fields[name] = declared[0]
        object.__setattr__(self, "fields", fields)

    def check(self, values: Mapping[str, Any]) -> Any:
        """The flow function's argument from the values given, defaults filled in."""
        rest = {**self.defaults, **values}
        *extras, main = self.models
        # The extras first: retrain's margin or a scaling run's sizes, as the flows did.
        checked = [
            validate_params(model, {k: rest.pop(k) for k in list(rest) if k in model.model_fields})
            for model in extras
        ]
        training = validate_params(main, {**rest, **self.fixed})
        return (*checked, training) if extras else training

    def help(self, name: str) -> str:
        """The declared description, with the declared limits ("1 to 64") after it."""
        info = self.fields[name]
        shown = limits(info)
        return f"{info.description} [{shown}]" if shown else str(info.description)

    def signature(self, returns: Any) -> inspect.Signature:
        return inspect.Signature(
            [
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,  # the function takes **values only
                    default=default,
                    annotation=wire_type(self.fields[name].annotation),
                )
                for name, default in self.defaults.items()
            ],
            return_annotation=returns,
        )


def limits(info: FieldInfo) -> str:
    """A field's bounds or choices as text: "1 to 64", "> 0, <= 10", "adam, sgd"."""
    choices = _literal_values(info.annotation)
    if choices:
        return ", ".join(str(c) for c in choices)
    if any(getattr(m, "min_length", None) for m in info.metadata):
        return "not empty"
    found = bounds_of(info)
    if found.keys() == {"ge", "le"}:
        return f"{_number(found['ge'])} to {_number(found['le'])}"
    return ", ".join(f"{BOUNDS[k]} {_number(v)}" for k, v in found.items())


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _literal_values(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    if _is_union(annotation):
        members = typing.get_args(annotation)
        if any(typing.get_origin(m) is Literal for m in members):
            # bool | Literal["auto"]: the values a user types, the named ones first.
            ordered = sorted(members, key=lambda m: typing.get_origin(m) is not Literal)
            return [v for m in ordered for v in (_literal_values(m) or _bool_values(m))]
    return []


def _bool_values(annotation: Any) -> list[Any]:
    return ["true", "false"] if annotation is bool else []


def _is_union(annotation: Any) -> bool:
    return isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union


def wire_type(annotation: Any) -> Any:
    """The type Prefect casts a value to: Literal -> its values' type, str first in a union
    (command-line text such as "auto" or "False" reaches the model's own parsing)."""
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    if _is_union(annotation):
        members = list(dict.fromkeys(wire_type(m) for m in typing.get_args(annotation)))
        members.sort(key=lambda m: (m is not str, m is type(None)))
        return functools.reduce(operator.or_, members)
    return annotation


def flow(
    parameters: FlowParameters, **options: Any
) -> Callable[[Callable[[Any], R]], RedactedParamsFlow]:
    """Prefect's `@flow(**options)` (recorded parameters redacted) on a function of the
    validated parameters, called with one keyword per declared parameter."""

    def decorate(fn: Callable[[Any], R]) -> RedactedParamsFlow:
        def with_parameters(**values: Any) -> R:
            return fn(parameters.check(values))

        returns = typing.get_type_hints(fn).get("return", inspect.Signature.empty)
        signature = parameters.signature(returns)
        with_parameters.__signature__ = signature  # type: ignore[attr-defined]
        with_parameters.__annotations__ = {
            **{p.name: p.annotation for p in signature.parameters.values()},
            "return": returns,
        }
        for attribute in ("__module__", "__name__", "__qualname__"):
            setattr(with_parameters, attribute, getattr(fn, attribute))
        summary = inspect.getdoc(fn) or ""
        # Prefect's parameter schema takes each parameter's description from an Args section.
        args = "\n".join(f"    {name}: {parameters.help(name)}" for name in parameters.defaults)
        with_parameters.__doc__ = f"{summary}\n\nArgs:\n{args}\n"
        with_parameters.__flow_parameters__ = parameters  # type: ignore[attr-defined]
        source = inspect.getsourcefile(fn)
        # As Prefect's default: a hash of the flow's own file, not of this one.
        options.setdefault("version", file_hash(source) if source else None)
        options.setdefault("description", summary)
        return redacted_flow(**options)(with_parameters)

    return decorate


def declared(flow: RedactedParamsFlow) -> FlowParameters:
    """The parameter declaration a flow was built from."""
    return flow.fn.__flow_parameters__  # type: ignore[attr-defined]
