"""ddpflow: DDP training on Dask, tracked in MLflow.

The public API (docs/api.md): write `train(ctx, *args)` against a TrainContext and run it
with `ddpflow.run(client, train, ...)`. The names load on first use, so `import ddpflow`
stays cheap (no torch, Dask or MLflow import) for code that needs only a submodule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpflow.api import run
    from ddpflow.distributed.elastic import (
        RepeatedFailure,
        Restart,
        RestartsExhausted,
        WorkersNotBack,
    )
    from ddpflow.distributed.failures import LaunchError
    from ddpflow.train_context import Stateful, TrainContext

_EXPORTS = {
    "run": "ddpflow.api",
    "TrainContext": "ddpflow.train_context",
    "Stateful": "ddpflow.train_context",
    "Restart": "ddpflow.distributed.elastic",
    "RestartsExhausted": "ddpflow.distributed.elastic",
    "RepeatedFailure": "ddpflow.distributed.elastic",
    "WorkersNotBack": "ddpflow.distributed.elastic",
    "LaunchError": "ddpflow.distributed.failures",
}
__all__ = [
    "LaunchError",
    "RepeatedFailure",
    "Restart",
    "RestartsExhausted",
    "Stateful",
    "TrainContext",
    "WorkersNotBack",
    "run",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ddpflow' has no attribute {name!r}")
