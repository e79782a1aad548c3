"""The optional package each cluster kind needs, imported only when that kind is used."""

from __future__ import annotations

import importlib
from types import ModuleType

from ddpflow.config import CLUSTER_ENV, ConfigError

# kind -> (module to import, extra that installs it)
EXTRAS = {
    "cuda": ("dask_cuda", "cuda"),
    "jobqueue": ("dask_jobqueue", "jobqueue"),
    "kubernetes": ("dask_kubernetes.operator", "kubernetes"),
}


def require_extra(kind: str) -> ModuleType:
    """Import the package a cluster kind needs, or say which extra installs it."""
    module, extra = EXTRAS[kind]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"cluster kind {kind!r} ({CLUSTER_ENV}={kind}) needs the extra: "
            f"pip install 'ddpflow[{extra}]' ({error})"
        ) from None
