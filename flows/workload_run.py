"""The MLflow run of a workload's training (or its scaling parent), recorded one way.

Every training run carries the same tags (the Prefect flow run, the workload, the readable
identity of flows.inspection), lives in the project's artifact location and logs its
input datasets; only the parameters and datasets are the workload's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect.runtime import flow_run

from ddpflow.config import Settings
from ddpflow.tracking.inspection import DatasetRef, log_datasets
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import default_artifact_location, start_run
from flows.inspection import run_identity, run_origin


def start_workload_run(
    settings: Settings,
    experiment: str,
    workload: str,
    description: str,
    datasets: Sequence[DatasetRef],
    params: Mapping[str, Any],
    tags: Mapping[str, str] | None = None,
    parent: RunRef | None = None,
    world_size: int | None = None,
) -> RunRef:
    """Start the run named `<workload>-<flow run id>` (readably, see run_identity), with
    `params`, the standard tags plus `tags`, and `datasets` logged as its inputs.

    With `parent`, a child run (a scaling run's size): its name ends with `world_size` so the
    sizes stand apart under their parent in the MLflow UI.
    """
    flow_run_id = str(flow_run.get_id())
    run_name, identity_tags = run_identity(
        run_origin(), f"{workload}-{flow_run_id}", description, datasets
    )
    if parent is not None:
        run_name = f"{run_name} world size {world_size}"
    run = start_run(
        settings.tracking_uri,
        experiment,
        run_name=run_name,
        params=params,
        tags={
            "prefect.flow_run_id": flow_run_id,
            "ddpflow.workload": workload,
            **identity_tags,
            **(tags or {}),
        },
        artifact_location=default_artifact_location(
            settings.tracking_uri, settings.mlflow_artifacts
        ),
        parent_run_id=parent.run_id if parent else None,
    )
    log_datasets(run, datasets)
    return run
