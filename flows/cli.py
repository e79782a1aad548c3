"""`python -m flows.<name> --field value`: a flow's parameter model as command-line options."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from prefect import Flow
from prefect.exceptions import ParameterTypeError
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from ddpflow.integrations.prefect import early_api
from ddpflow.storage.redact import redact_text
from flows.param_docs import field_help, parameter

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


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None


def _takes_json(field: dict[str, Any]) -> bool:
    """A dict or list field (e.g. --grid '{"lr": [0.001, 0.01]}') is given as JSON."""
    return any(m.get("type") in ("object", "array") for m in field.get("anyOf", [field]))


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    return value


@contextlib.contextmanager
def _unlogged(name: str) -> Iterator[None]:
    """The logger `name` says nothing while the block runs."""
    logger = logging.getLogger(name)
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def parse_args(flow: Flow, argv: list[str] | None = None) -> dict[str, Any]:
    """The fields given on the command line (--field value), as text, or JSON for a dict or
    list field; `--help` lists every field of the flow's parameter model."""
    # Under `python -m`, the flow's module is __main__; its spec still has the real name.
    spec = getattr(sys.modules.get(flow.fn.__module__), "__spec__", None)
    module = spec.name if spec else flow.fn.__module__
    parser = argparse.ArgumentParser(
        prog=f"python -m flows.{module.split('.')[-1]}", description=flow.description
    )
    fields = parameter(flow)[2]
    groups = {title: parser.add_argument_group(title) for title in HELP_GROUPS}
    for field in sorted(fields, key=_help_order):
        schema = fields[field]
        group = groups[help_group(field)]
        option = f"--{field.replace('_', '-')}"
        if schema.get("type") == "boolean":  # a switch: --compile / --no-compile
            default = f"--{'' if schema['default'] else 'no-'}{field.replace('_', '-')}"
            group.add_argument(
                option,
                dest=field,
                default=argparse.SUPPRESS,
                action=argparse.BooleanOptionalAction,
                help=f"{field_help(schema)}; default: {default}".replace("%", "%%"),
            )
            continue
        group.add_argument(
            option,
            dest=field,
            default=argparse.SUPPRESS,
            type=_parse_json if _takes_json(schema) else str,
            help=f"{field_help(schema)}; default: {schema['default']!r}".replace("%", "%%"),
        )
    return vars(parser.parse_args(argv))


# `--help` lists a flow's options in the order a user decides them: what to learn from, the
# model, how to train it, on how many workers, where the result goes. A field missing here
# lands in "other" (tests/unit/test_cli_help.py fails on it, so a new field gets a place).
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "data": (
        "source", "holdout_fraction", "val_fraction", "image_size", "resize", "augment",
        "max_bad_fraction", "max_image_mb", "data_layout", "stream_above_mb", "shard_mb",
        "shard_encoding", "jpeg_quality",
    ),
    "model": ("arch", "weights", "freeze_backbone", "hidden_size", "num_layers", "dropout"),
    "training": (
        "epochs", "batch_size", "global_batch", "lr", "optimizer", "lr_patience", "seed",
        "target_loss", "target_accuracy", "precision", "channels_last", "compile",
        "pin_memory", "checkpoint_every_steps", "checkpoint_every_s", "keep_last",
        "max_restarts", "rank_timeout_s",
    ),
    "search": (
        "grid", "trials", "search", "sampler", "n_trials", "budget_epochs", "pruner",
        "min_epochs", "eta", "study_name",
    ),
    "cluster": ("world_size", "min_workers", "max_workers", "ranks_per_trial", "world_sizes"),
    "tracking and registry": ("experiment", "model_name", "num_names", "margin", "promote"),
    "other": (),
}  # fmt: skip


def help_group(field: str) -> str:
    return next((title for title, names in HELP_GROUPS.items() if field in names), "other")


def _help_order(field: str) -> tuple[int, int]:
    title = help_group(field)
    names = HELP_GROUPS[title]
    return list(HELP_GROUPS).index(title), names.index(field) if field in names else 0


def run_cli(flow: Flow, argv: list[str] | None = None) -> Any:
    """Run the flow with the fields given on the command line; exit 1 on failure.

    Values are text, parsed by the flow's parameter model as Prefect would parse them. A
    valid set goes to the flow as the model, so Prefect records every field. An invalid one
    goes as given but redacted: Prefect records the run and refuses it with the model's
    explanation, and a credential in a URI never reaches its records (a value that
    redaction changes is one the model refuses: flows.params).
    """
    given = parse_args(flow, argv)
    name = parameter(flow)[0]
    try:
        # Prefect logs a refused set of parameters as given, credentials and all ("Parameter
        # validation failed ... Parameters: {...}"): this first check, on the values as
        # typed, logs nothing; the flow's own check then sees them redacted.
        with _unlogged("prefect.flows"):
            value: Any = flow.validate_parameters({name: given})[name]
    except ParameterTypeError:
        value = _redacted(given)
    # The ephemeral API server would try to send telemetry over a network we may not have.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        early_api.wait_until_ready()  # after argument errors, which need no server
        with prefect_client_retries():
            return flow(**{name: value})
    except Exception as error:  # noqa: BLE001 - a CLI ends with one clear line, not a traceback
        # Errors raised by ddpflow are redacted already; a library's may quote a URL.
        reason = redact_text(str(error)) or type(error).__name__  # TimeoutError() says nothing
        if isinstance(error, ParameterTypeError):  # Prefect lists them one per line
            reason = reason.replace("\n - ", " ")
        print(f"\nddpflow: {flow.name} failed: {reason}", file=sys.stderr)
        sys.exit(1)
