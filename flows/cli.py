"""`python -m flows.<name> --param value`: flow parameters as command-line options."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import types
import typing
from typing import Any

from prefect import Flow
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from ddpflow.integrations.prefect import early_api
from ddpflow.storage.redact import redact_text

# Prefect's client retries a request to an API it has reached before, pausing 1, 2, 4, ... s.
# Its default 5 retries span about 30 s, less than a server restart on a busy host takes
# (a state update then fails the flow run); 8 span about 4 minutes. A URL that never
# answered still fails at once: Prefect does not retry a first connection.
CLIENT_MAX_RETRIES = 8
CLIENT_RETRIES_ENV = "PREFECT_CLIENT_MAX_RETRIES"


def prefect_client_retries() -> contextlib.AbstractContextManager[Any]:
    """CLIENT_MAX_RETRIES for this flow run, unless the environment sets its own.

    Prefect read its settings when it was imported, so the flow's process gets them as a
    temporary setting; the environment variable is for the processes it starts afterwards
    (a LocalCluster's workers run tasks that talk to the API too).
    """
    if os.environ.get(CLIENT_RETRIES_ENV, "").strip():
        return contextlib.nullcontext()
    os.environ[CLIENT_RETRIES_ENV] = str(CLIENT_MAX_RETRIES)
    return temporary_settings({PREFECT_CLIENT_MAX_RETRIES: CLIENT_MAX_RETRIES})


def _scalar_type(annotation: Any) -> type:
    if isinstance(annotation, str):
        annotation = eval(annotation, {}, {})  # noqa: S307 - annotations of our own flows
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None


def _arg_type(annotation: Any) -> Any:
    """bool, dict and list parameters need parsing; `bool("false")` would be True."""
    scalar = _scalar_type(annotation)
    if scalar is bool:
        return _parse_bool
    if typing.get_origin(scalar) in (dict, list) or scalar in (dict, list):
        return _parse_json  # e.g. --grid '{"lr": [0.001, 0.01]}'
    return scalar


def run_cli(flow: Flow, argv: list[str] | None = None) -> Any:
    """Parse --name value for each flow parameter, run the flow, exit 1 on failure."""
    # Under `python -m`, the flow's module is __main__; its spec still has the real name.
    spec = getattr(sys.modules.get(flow.fn.__module__), "__spec__", None)
    module = spec.name if spec else flow.fn.__module__
    parser = argparse.ArgumentParser(
        prog=f"python -m flows.{module.split('.')[-1]}", description=flow.description
    )
    hints = typing.get_type_hints(flow.fn)  # resolves `from __future__` string annotations
    # Each parameter's help as Prefect's parameter schema shows it (flows.param_flow).
    schema = flow.parameters.properties
    for name, param in inspect.signature(flow.fn).parameters.items():
        described = schema.get(name, {}).get("description")
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=param.default,
            type=_arg_type(hints.get(name, param.annotation)),
            help=f"{described.replace('%', '%%')}; default: {param.default!r}"
            if described
            else f"default: {param.default!r}",
        )
    args = vars(parser.parse_args(argv))
    # The ephemeral API server would try to send telemetry over a network we may not have.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    early_api.adopt()  # after argument errors, which need no server
    try:
        with prefect_client_retries():
            return flow(**args)
    except Exception as error:  # noqa: BLE001 - a CLI ends with one clear line, not a traceback
        # Errors raised by ddpflow are redacted already; a library's may quote a URL.
        reason = redact_text(str(error)) or type(error).__name__  # TimeoutError() says nothing
        print(f"\nddpflow: {flow.name} failed: {reason}", file=sys.stderr)
        sys.exit(1)
