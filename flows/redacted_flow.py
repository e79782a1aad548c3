"""Prefect's `flow` decorator, with URL credentials kept out of the recorded parameters.

Prefect stores a flow run's parameters in its API database (shown by the UI and by
`prefect flow-run inspect`) before the flow body runs, so a check in the body comes too
late to keep a secret out. The flows refuse credentials in URI parameters (see
flows.params); this records any such value redacted, so the refusal itself leaks nothing.
A deployment run's parameters are stored by whoever creates the run, before any of this
code runs: there too, credentials belong in the environment, never in a parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect.flows import Flow

from ddpflow.storage.redact import redact_text


class RedactedParamsFlow(Flow):
    """A Flow whose recorded parameters have every URL credential replaced by ***."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        return {k: _redact(v) for k, v in super().serialize_parameters(parameters).items()}


def _redact(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, list):
        return [_redact(item) for item in value]
    if isinstance(value, dict):
        return {key: _redact(item) for key, item in value.items()}
    return value


def flow(**options: Any) -> Callable[[Callable[..., Any]], RedactedParamsFlow]:
    """`@flow(name=..., ...)` as Prefect's, building a RedactedParamsFlow."""

    def decorate(fn: Callable[..., Any]) -> RedactedParamsFlow:
        return RedactedParamsFlow(fn=fn, **options)

    return decorate
