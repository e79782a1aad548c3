"""Prefect around ddpflow.run: `ddpflow.run_in_flow` (the `ddp-train` task), the flow's Dask
client, and the progress artifact that follows a training. The only part of the library that
imports prefect, loaded when a user (or the built-in tasks) asks for it.

Prefect is the `flows` extra, not a library requirement: without it, importing anything here
fails at once naming the extra. find_spec only looks the packages up, so the modules that
run before a flow's own imports (early_api, db_template) stay as cheap as they were.
"""

from __future__ import annotations

from importlib.util import find_spec

from ddpflow.cluster.extras import missing_extra

for _package in ("prefect", "prefect_dask"):
    if find_spec(_package) is None:
        raise missing_extra(
            "flows",
            "ddpflow's Prefect integration (ddpflow.run_in_flow, ddpflow.dask_task_runner)",
            ModuleNotFoundError(f"No module named {_package!r}", name=_package),
        )
