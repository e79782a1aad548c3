"""Whether a Dask process (worker or scheduler) can import the project's code.

A flow's tasks are functions of the checkout's `flows` and `tasks` packages, pickled by
reference: the scheduler unpickles the task graph and every worker the tasks it runs, so
both must import those packages (the checkout on their PYTHONPATH). A cluster the flow did
not start may lack that; without this probe its first task fails with Dask's "Error during
deserialization of the task graph ... No module named 'flows'".
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

# What a flow's task graph refers to, besides the library itself.
PROJECT_MODULES = ("ddpflow", "flows", "tasks")


def import_failures(modules: Sequence[str] = PROJECT_MODULES) -> str | None:
    """Run on a Dask process: None when every module imports, else which do not and why."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure to import is the answer
            failed.append(f"{name} ({type(error).__name__}: {error})")
    return f"cannot import {', '.join(failed)}" if failed else None
