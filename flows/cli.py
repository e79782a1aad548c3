"""`python -m flows.<name> --param value`: flow parameters as command-line options."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import types
import typing
from typing import Any

from prefect import Flow


def _scalar_type(annotation: Any) -> type:
    if isinstance(annotation, str):
        annotation = eval(annotation, {}, {})  # noqa: S307 - annotations of our own flows
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


def run_cli(flow: Flow, argv: list[str] | None = None) -> Any:
    """Parse --name value for each flow parameter, run the flow, exit 1 on failure."""
    parser = argparse.ArgumentParser(
        prog=f"python -m flows.{flow.fn.__module__.split('.')[-1]}", description=flow.description
    )
    for name, param in inspect.signature(flow.fn).parameters.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=param.default,
            type=_scalar_type(param.annotation),
            help=f"default: {param.default!r}",
        )
    args = vars(parser.parse_args(argv))
    # The ephemeral API server would try to send telemetry over a network we may not have.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        return flow(**args)
    except Exception as error:  # noqa: BLE001 - a CLI ends with one clear line, not a traceback
        print(f"\nddpflow: {flow.name} failed: {error}", file=sys.stderr)
        sys.exit(1)
