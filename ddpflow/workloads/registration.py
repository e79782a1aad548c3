"""Registering a trained model from its checkpoint, in a fresh Python process.

Registration exports the model with torch.export (MLflow's pt2 format). The export traces
the model under torch's fake-tensor machinery, whose state lives in the process: the
tracing modes and patched functions while a trace runs, dynamo's caches, other threads
using torch meanwhile (not the model: it is loaded fresh from the checkpoint, and torch
restores what a trace re-assigns on it). In a long-lived Dask worker that has run ranks,
evaluations and earlier exports, the export failed intermittently ("We found a fake tensor
in the exported program constant's list ... model.lstm"), after the expensive training had
succeeded. A fresh interpreter carries none of that state: an export that fails in the
worker's process is run again in one (`python -m ddpflow.workloads.registration`, what
tasks.registration does), which rebuilds the model from the checkpoint itself, so nothing
but the checkpoint's URI crosses the process boundary. The child's start and imports cost
10-20 s on a busy 2-core machine (an in-process registration of the default pet-name model:
3-7 s), which is why it is the second try, not the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Literal

from ddpflow.storage.redact import redact_text
from ddpflow.tracking.loggers import RunRef

Workload = Literal["charlm", "images"]
WORKLOADS: tuple[Workload, ...] = ("charlm", "images")
EXPORT_TIMEOUT_S = 900.0  # a ResNet-50 export on a busy CPU takes minutes, never this long
# The tracking URI goes to the child in the environment, not on its command line, which
# any local user can read (ps).
TRACKING_ENV = "MLFLOW_TRACKING_URI"


class RegistrationError(RuntimeError):
    """Registering a checkpoint's model failed; the message names the cause."""


def register_from_checkpoint(
    workload: str, run: RunRef, checkpoint_uri: str, model_name: str
) -> str:
    """In this process: load the checkpoint's model, log and register it; the version."""
    return _register_fn(workload)(run, checkpoint_uri, model_name)


def register_in_fresh_process(
    workload: str,
    run: RunRef,
    checkpoint_uri: str,
    model_name: str,
    timeout_s: float = EXPORT_TIMEOUT_S,
) -> str:
    """register_from_checkpoint in a new interpreter (see the module's docstring)."""
    _check_workload(workload)  # before a process starts
    command = [sys.executable, "-m", __name__, workload, checkpoint_uri, model_name, run.run_id]
    try:
        done = subprocess.run(
            command,
            env={**os.environ, TRACKING_ENV: run.tracking_uri},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RegistrationError(
            f"registering {model_name!r} took longer than {timeout_s:g} s (the export hung)"
        ) from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise RegistrationError(f"registering {model_name!r} failed: {redact_text(tail[0])}")
    return str(json.loads(done.stdout.strip().splitlines()[-1])["version"])


def _register_fn(workload: str) -> Callable[[RunRef, str, str], str]:
    _check_workload(workload)
    # Imported on use: the pet-name model never loads torchvision, and the reverse.
    if workload == "charlm":
        from ddpflow.workloads.charlm.evaluation import register_model
    else:
        from ddpflow.workloads.vision.evaluation import register_model
    return register_model


def _check_workload(workload: str) -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} is not one of {', '.join(WORKLOADS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Register a checkpoint's model in MLflow.")
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("checkpoint_uri")
    parser.add_argument("model_name")
    parser.add_argument("run_id")
    args = parser.parse_args(argv)
    run = RunRef(os.environ[TRACKING_ENV], args.run_id)
    version = register_from_checkpoint(args.workload, run, args.checkpoint_uri, args.model_name)
    print(json.dumps({"version": version}))


if __name__ == "__main__":
    main()
