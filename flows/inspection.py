"""The Prefect side of what a user inspects: the flow run's name, link and tags, and the
links from the flow run to what it produced in MLflow.

Called from the flow bodies (they need the flow run's context); the MLflow side is
ddpflow.tracking.inspection.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from uuid import UUID

from mlflow.tracking import MlflowClient
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from ddpflow.storage.redact import redact_text, redact_url
from ddpflow.tracking.inspection import (
    NOTE_TAG,
    DatasetRef,
    RunOrigin,
    experiment_url,
    git_commit,
    model_version_url,
    run_description,
    run_url,
)
from ddpflow.tracking.loggers import RunRef

log = logging.getLogger(__name__)
WORKLOAD_TAG_PREFIX = "workload:"


def run_origin() -> RunOrigin:
    """The running flow run: its readable name, its UI link, and the code's commit."""
    run_id = flow_run.get_id()
    url = f"{PREFECT_UI_URL.value()}/runs/flow-run/{run_id}" if PREFECT_UI_URL.value() else None
    return RunOrigin(
        flow_name=flow_run.get_flow_name() or "flow",
        flow_run_name=flow_run.get_name(),
        flow_run_id=str(run_id) if run_id else None,
        flow_run_url=url,
        commit=git_commit(),
    )


def run_identity(
    origin: RunOrigin, fallback_name: str, what: str, datasets: Sequence[DatasetRef]
) -> tuple[str, dict[str, str]]:
    """The MLflow run name (the flow run's readable name) and the tags that describe it."""
    tags = {**origin.tags(), NOTE_TAG: run_description(origin, what, datasets)}
    return origin.flow_run_name or fallback_name, tags


def tag_flow_run(workload: str) -> None:
    """Tag the running flow run `workload:<name>`, so the Prefect UI filters by workload.

    The flow decorator takes no tags and a deployment's tags cover only its own runs, so
    the flow tags itself. A failure to do so is only logged.
    """
    run_id = flow_run.get_id()
    if run_id is None:
        return
    try:
        flow_run_id = UUID(run_id)  # Prefect's client takes the id as a UUID
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(flow_run_id).tags
            wanted = [*current, f"{WORKLOAD_TAG_PREFIX}{workload}"]
            client.update_flow_run(flow_run_id, tags=list(dict.fromkeys(wanted)))
    except Exception as error:  # noqa: BLE001 - a missing tag is no reason to stop a training
        log.warning("flow run not tagged %s: %s", workload, redact_text(str(error)))


def publish_mlflow_links(
    run: RunRef, key: str, model_name: str | None = None, version: str | None = None
) -> str:
    """A markdown artifact on the flow run that links its MLflow run and model version.

    It comes after the training is done and recorded: a failure here is only logged.
    """
    try:
        return _publish_links(run, key, model_name, version)
    except Exception as error:  # noqa: BLE001 - the training and its records are complete
        log.warning("no MLflow links artifact %s: %s", key, redact_text(str(error)))
        return ""


def _publish_links(run: RunRef, key: str, model_name: str | None, version: str | None) -> str:
    experiment_id = MlflowClient(run.tracking_uri).get_run(run.run_id).info.experiment_id
    lines = ["# In MLflow", "", "| | |", "|---|---|"]
    lines.append(f"| run | {_link(run_url(run.tracking_uri, experiment_id, run.run_id))} |")
    lines.append(f"| experiment | {_link(experiment_url(run.tracking_uri, experiment_id))} |")
    if model_name and version:
        url = model_version_url(run.tracking_uri, model_name, version)
        lines.append(f"| model version | {_link(url, f'{model_name} v{version}')} |")
    lines += ["", f"Tracking store: `{redact_url(run.tracking_uri)}`"]
    markdown = "\n".join(lines) + "\n"
    create_markdown_artifact(markdown=markdown, key=key, description="the MLflow run and model")
    return markdown


def _link(url: str, text: str | None = None) -> str:
    if url.startswith(("http://", "https://")):
        return f"[{text or url}]({url})"
    return f"`{url}`"
