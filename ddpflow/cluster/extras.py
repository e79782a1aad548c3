"""The optional packages: each is imported only where it is used, and a missing one fails
naming the extra (pyproject.toml's optional-dependencies) that installs it.

`pip install ddpflow` is the library that runs on Dask workers and in plain scripts; the
cluster kinds, the plots, the digits demo data and the Prefect integration each need an
extra, so a worker's environment holds none of them unless it asks.
"""

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


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra that installs it.

    An ImportError, so code that already treats a failed import as "not available" still
    does."""


def missing_extra(extra: str, needed_for: str, error: ImportError) -> MissingExtra:
    """The error for `needed_for` (what the user called) without the package of `extra`.

    For module-level imports, which keep their static types this way:
    `try: from matplotlib.figure import Figure` / `except ImportError as error:
    raise missing_extra("plots", "...", error) from None`."""
    return MissingExtra(
        f"{needed_for} needs the extra: pip install 'ddpflow[{extra}]' ({error})",
        name=error.name,
    )


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
