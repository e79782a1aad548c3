"""Reading flow runs, their state history and artifacts from a Prefect server's REST API,
and starting a deployment's run.

The calls go over HTTP from the test process, with the basic-auth string the stack's clients
use: no Prefect client settings of this process get involved, and a poll costs milliseconds.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import UUID

import httpx

from tests.helpers.prefect_reads import every_page

FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})


def _request(env: dict[str, str], method: str, path: str, body: Any = None) -> Any:
    user, _, password = env.get("PREFECT_API_AUTH_STRING", "").partition(":")
    response = httpx.request(
        method,
        env["PREFECT_API_URL"].rstrip("/") + path,
        json=body,
        auth=(user, password) if user else None,
        timeout=30,
    )
    response.raise_for_status()
    return response.json()


def flow_run(env: dict[str, str], flow_run_id: str) -> dict[str, Any]:
    return _request(env, "GET", f"/flow_runs/{flow_run_id}")


def state_history(env: dict[str, str], flow_run_id: str) -> list[dict[str, Any]]:
    """Every state the run went through, oldest first."""
    states = _request(env, "GET", f"/flow_run_states/?flow_run_id={flow_run_id}")
    return sorted(states, key=lambda s: s["timestamp"])


def artifacts(env: dict[str, str], key: str, flow_run_id: str) -> list[dict[str, Any]]:
    """The artifacts with `key` that one flow run created."""
    filters = {"artifacts": {"key": {"any_": [key]}, "flow_run_id": {"any_": [flow_run_id]}}}
    return _request(env, "POST", "/artifacts/filter", filters)


def wait_for_state(
    env: dict[str, str], flow_run_id: str, types: set[str] | frozenset[str], timeout_s: float
) -> dict[str, Any]:
    """Poll until the run's state type is one of `types`; fail on another final state."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = flow_run(env, flow_run_id)
        state = run["state"]["type"]
        if state in types:
            return run
        assert state not in FINAL_STATES, f"flow run {flow_run_id} ended {run['state']}"
        assert time.monotonic() < deadline, f"flow run {flow_run_id} still {run['state']}"
        time.sleep(0.5)


def deployment(env: dict[str, str], name: str) -> dict[str, Any]:
    """A deployment by its `flow-name/deployment-name`, as `prefect deployment inspect`
    shows it."""
    flow_name, _, deployment_name = name.partition("/")
    return _request(env, "GET", f"/deployments/name/{flow_name}/{deployment_name}")


def create_flow_run(env: dict[str, str], name: str, parameters: dict[str, Any]) -> str:
    """A run of the deployment `flow-name/deployment-name`, as its schedule or
    `prefect deployment run` (without --watch) makes one: its id. Milliseconds, where the
    command line takes seconds to import Prefect. Through Prefect's client, which retries
    what a busy server answers (503 while SQLite is locked by the runs' own writes), as the
    command line does: a bare POST failed there once."""
    from prefect.client.orchestration import SyncPrefectClient

    deployment_id = UUID(deployment(env, name)["id"])
    auth = env.get("PREFECT_API_AUTH_STRING") or None
    with SyncPrefectClient(env["PREFECT_API_URL"], auth_string=auth) as client:
        run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
    return str(run.id)


def flow_run_logs(env: dict[str, str], flow_run_id: str) -> str:
    """The run's log messages oldest first, a line each (a message's own lines kept), as
    `prefect flow-run logs` lists them."""

    def page(offset: int) -> list[dict[str, Any]]:
        where = {"flow_run_id": {"any_": [flow_run_id]}}
        body = {"logs": where, "sort": "TIMESTAMP_ASC", "limit": 200, "offset": offset}
        return _request(env, "POST", "/logs/filter", body)

    return "\n".join(log["message"] for log in every_page(page))
