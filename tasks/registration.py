"""Registering a trained model in MLflow: one task for every workload.

Each workload knows how to load its checkpoint into a servable model (its evaluation
module's `register_model`, which goes through ddpflow.registry.serving); the task around it, and the
description the version gets, are the same for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from prefect import task

from ddpflow.tracking.inspection import describe_version
from ddpflow.tracking.loggers import RunRef

Workload = Literal["charlm", "images"]
Register = Callable[[RunRef, str, str], str]


def _register_fn(workload: Workload) -> Register:
    # Imported on use: the pet-name flows never load torchvision, and the reverse.
    if workload == "charlm":
        from ddpflow.workloads.charlm.evaluation import register_model
    elif workload == "images":
        from ddpflow.workloads.vision.evaluation import register_model
    else:
        raise ValueError(f"workload={workload!r} is not one of charlm, images")
    return register_model


@task(name="register-model")
def register(workload: Workload, run: RunRef, checkpoint_uri: str, model_name: str) -> str:
    """Log the final model to the MLflow run, register a new version and describe it."""
    version = _register_fn(workload)(run, checkpoint_uri, model_name)
    describe_version(run, model_name, version)
    return version
