"""`mlflow.pytorch`, imported without its side effect on the process's logging.

Importing it runs `logging.basicConfig(level=logging.ERROR)` (its Lightning autologging
module). In a process whose root logger is not configured yet (a Dask worker, a script, a
test) that silences every warning below ERROR, ddpflow's included, and the handler it adds
makes Prefect skip its own console logging. The root logger's level and handlers are put
back as they were.
"""

from __future__ import annotations

import logging
from types import ModuleType


def _import_keeping_root_logger() -> ModuleType:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        import mlflow.pytorch
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
    return mlflow.pytorch


mlflow_pytorch = _import_keeping_root_logger()
