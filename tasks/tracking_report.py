"""The flow's record of logging calls MLflow never took: a Prefect artifact and a log line.

Prefect, not MLflow: MLflow may be the very thing that is down when this is published.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.spool import Unsent, unsent_markdown


def publish_unsent(run: RunRef, unsent: Sequence[Unsent], key: str) -> None:
    """List each missing call and where its original is, as Prefect artifact `key`."""
    create_markdown_artifact(
        markdown=unsent_markdown(run.run_id, list(unsent)),
        key=key,
        description="logging calls the MLflow run does not have",
    )
    get_run_logger().error(
        "MLflow run %s is missing %d logging calls (listed in the Prefect artifact %r): %s",
        run.run_id,
        len(unsent),
        key,
        "; ".join(u.line() for u in unsent),
    )


def tracking_line(unsent: Sequence[Unsent], key: str) -> str:
    """The final summary's line about tracking: complete, or what is missing and where."""
    if not unsent:
        return "complete (every metric, tag and checkpoint is in MLflow)"
    return (
        f"INCOMPLETE: {len(unsent)} logging calls are not in MLflow; "
        f"Prefect artifact '{key}' lists them and where they are on disk"
    )
