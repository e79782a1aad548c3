"""ddpflow: DDP training on Dask, tracked in MLflow.

The public API (docs/api.md): write `train(ctx, *args)` against a TrainContext (with your
own loop, or `ddpflow.fit(ctx, ...)`, the loop the built-in workloads use) and run it with
`ddpflow.run(client, train, ...)`, or inside a Prefect flow with
`ddpflow.run_in_flow(train, ...)`. The names load on first use, so `import ddpflow` stays
cheap (no torch, Dask or MLflow import) for code that needs only a submodule; only
run_in_flow and dask_task_runner load prefect: they live in ddpflow.integrations.prefect,
the one part of the library that imports it, loaded only then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpflow.api import run
    from ddpflow.checkpoint.reading import LoadedCheckpoint, load_checkpoint
    from ddpflow.distributed.progress import Progress
    from ddpflow.distributed.supervisor.failures import LaunchError
    from ddpflow.distributed.supervisor.relaunch import (
        RepeatedFailure,
        Resize,
        Restart,
        RestartsExhausted,
        WorkersNotBack,
    )
    from ddpflow.integrations.prefect.run_in_flow import run_in_flow
    from ddpflow.integrations.prefect.task_runner import dask_task_runner
    from ddpflow.registry.load import load_registered_model
    from ddpflow.shards.index import read_index, write_records
    from ddpflow.shards.stream import ShardStream
    from ddpflow.training.context import Stateful, TrainContext
    from ddpflow.training.fit import fit
    from ddpflow.training.loop import FitHooks
    from ddpflow.training.result import EpochStats
    from ddpflow.training.samples import Samples, TensorPairs, TensorSamples

_EXPORTS = {
    "run": "ddpflow.api",
    "load_checkpoint": "ddpflow.checkpoint.reading",
    "LoadedCheckpoint": "ddpflow.checkpoint.reading",
    "load_registered_model": "ddpflow.registry.load",
    "fit": "ddpflow.training.fit",
    "FitHooks": "ddpflow.training.loop",
    "EpochStats": "ddpflow.training.result",
    "Samples": "ddpflow.training.samples",
    "TensorSamples": "ddpflow.training.samples",
    "TensorPairs": "ddpflow.training.samples",
    "run_in_flow": "ddpflow.integrations.prefect.run_in_flow",
    "dask_task_runner": "ddpflow.integrations.prefect.task_runner",
    "TrainContext": "ddpflow.training.context",
    "Stateful": "ddpflow.training.context",
    "Restart": "ddpflow.distributed.supervisor.relaunch",
    "Resize": "ddpflow.distributed.supervisor.relaunch",
    "RestartsExhausted": "ddpflow.distributed.supervisor.relaunch",
    "RepeatedFailure": "ddpflow.distributed.supervisor.relaunch",
    "WorkersNotBack": "ddpflow.distributed.supervisor.relaunch",
    "LaunchError": "ddpflow.distributed.supervisor.failures",
    "Progress": "ddpflow.distributed.progress",
    "ShardStream": "ddpflow.shards.stream",
    "read_index": "ddpflow.shards.index",
    "write_records": "ddpflow.shards.index",
}
__all__ = [
    "EpochStats",
    "FitHooks",
    "LaunchError",
    "LoadedCheckpoint",
    "Progress",
    "RepeatedFailure",
    "Resize",
    "Restart",
    "RestartsExhausted",
    "Samples",
    "ShardStream",
    "Stateful",
    "TensorPairs",
    "TensorSamples",
    "TrainContext",
    "WorkersNotBack",
    "dask_task_runner",
    "fit",
    "load_checkpoint",
    "load_registered_model",
    "read_index",
    "run",
    "run_in_flow",
    "write_records",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ddpflow' has no attribute {name!r}")
