"""A flow run's records (task runs, logs), read through Prefect's API."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def every_page(read: Callable[[int], list[Any]]) -> list[Any]:
    """Every record of a paged read from Prefect's API (it gives 200 at most per call):
    `read(offset)` until a page comes back empty."""
    found: list[Any] = []
    while batch := read(len(found)):
        found += batch
    return found


def flow_run_task_runs(flow_run_id: Any) -> list[Any]:
    """Every task run of the flow run, as the API holds it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        return every_page(
            lambda offset: client.read_task_runs(flow_run_filter=runs, limit=200, offset=offset)
        )


def completed_task_runs(flow_run_id: Any) -> list[str]:
    """Names of the flow run's task runs that completed, one entry per run (Prefect names a
    task run with 3 hex digits, so two may share a name)."""
    found = flow_run_task_runs(flow_run_id)
    return [run.name for run in found if run.state and run.state.is_completed()]


@contextmanager
def own_tag() -> Iterator[str]:
    """A tag of its own on the flow runs started in the block (`prefect.tags`), so that
    `latest_flow_run(name, tag)` finds this block's run in an API other test processes
    share, where a test cannot know its run's id."""
    import prefect

    tag = f"test-{uuid.uuid4().hex}"
    with prefect.tags(tag):
        yield tag


def latest_flow_run(flow_name: str, tag: str | None = None) -> Any:
    """The flow's last run in the API (flow_services'); with `tag`, its last run with that
    tag (own_tag)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    tagged = None if tag is None else FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            flow_run_filter=tagged,
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=1,
        )
    assert runs, f"no run of {flow_name} recorded" + (f" with tag {tag}" if tag else "")
    return runs[0]


def flow_run_records(flow_run_id: Any) -> dict:
    """The flow run, its task runs (states and their messages), logs and artifacts as the
    API (flow_services') holds them, as Prefect's client gives them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    task_runs = flow_run_task_runs(flow_run_id)
    where = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        logs = every_page(lambda offset: client.read_logs(where, limit=200, offset=offset))
        return {
            "flow_runs": [client.read_flow_run(flow_run_id).model_dump(mode="json")],
            "task_runs": [r.model_dump(mode="json") for r in task_runs],
            "logs": [r.model_dump(mode="json") for r in logs],
            "artifacts": [a.model_dump(mode="json") for a in artifacts],
        }


def flow_run_logs(flow_run_id: Any, *expect: str, timeout_s: float = 30) -> str:
    """The flow run's log lines, its task runs' included, as the API stored them. Each
    process sends its lines in batches: waits until every `expect` text has arrived (a line
    of the flow's own and one of a worker's, say), then returns all of them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    where = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            logs = every_page(lambda offset: client.read_logs(where, limit=200, offset=offset))
            text = "\n".join(f"{log.name} - {log.message}" for log in logs)
            if all(e in text for e in expect) or time.monotonic() > deadline:
                return text
            time.sleep(1)
