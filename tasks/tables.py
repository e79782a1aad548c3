"""Result tables as Prefect artifacts (the sweep's ranking, the scaling runs' table)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact


@task(name="publish-table")
def publish_table(rows: list[dict[str, Any]], key: str, description: str) -> None:
    """`rows` as a Prefect table artifact: the latest version under `key`, one per flow run."""
    create_table_artifact(table=rows, key=key, description=description)
