"""Where the stack's programs are and the environment they start from."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Console scripts of the venv that runs us (moto_server, mlflow, prefect, dask).
BIN = Path(sys.executable).parent


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without Prefect/MLflow/Dask settings that could point elsewhere."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "DASK_", "DDPFLOW_"))
    }
    env.update(extra or {})
    return env
