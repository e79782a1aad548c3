"""Flows called in the test's own process, as their project would run them."""

from __future__ import annotations

import concurrent.futures
import contextvars
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.prefect_reads import (
    flow_run_logs,
)


def dotted_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} as {"a.b": 1}: dask.config.set replaces a whole subtree it is given."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(dotted_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_in_process(
    flow: Any,
    project: Path,
    address: str | None,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
    **parameters: Any,
) -> Any:
    """Call `flow(**parameters)` in this process, as its project would run it (its own
    artifact folder and MLflow file, then `env`), on the Dask scheduler at `address` (the
    module's flow_services'), or with address None on a LocalCluster the flow starts."""
    project.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(project)
    settings = {
        "DDPFLOW_ARTIFACT_ROOT": str(project / "artifacts"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
    }
    if address:
        settings["DDPFLOW_DASK_ADDRESS"] = address
    else:
        monkeypatch.delenv("DDPFLOW_DASK_ADDRESS", raising=False)
    settings.update(env or {})
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    return flow(**parameters)


def cli_exit_code(
    flow: Any,
    args: list[str],
    project: Path,
    address: str | None,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
) -> Any:
    """Run the flow's command line (`flows.cli.run_cli`: its option parser, its failure line)
    in this process as run_in_process runs a flow; the code it exits with. run_cli sets its
    client retries in os.environ when they are unset: set here, monkeypatch restores them."""
    from flows.cli import CLIENT_MAX_RETRIES, CLIENT_RETRIES_ENV, run_cli

    env = {CLIENT_RETRIES_ENV: str(CLIENT_MAX_RETRIES), **(env or {})}
    with pytest.raises(SystemExit) as exited:
        run_in_process(lambda: run_cli(flow, args), project, address, monkeypatch, env)
    return exited.value.code


def start_in_process(
    flow: Any,
    project: Path,
    address: str | None,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
    **parameters: Any,
) -> concurrent.futures.Future[Any]:
    """run_in_process in a thread, so the test can act while the flow trains (stop a worker,
    say); the future gives the flow's final state (`return_state=True`). The thread runs in
    a copy of this thread's context: Prefect's settings, the test harness's API among them,
    are context variables, and a plain thread would start without them."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flow-under-test")
    context = contextvars.copy_context()
    future = pool.submit(
        context.run, run_in_process, flow, project, address, monkeypatch, env,
        return_state=True, **parameters,
    )  # fmt: skip
    pool.shutdown(wait=False)
    return future


def finish_in_process(
    flow_run: concurrent.futures.Future[Any], *expect: str, timeout_s: float = 600
) -> tuple[Any, str]:
    """A flow run started by start_in_process: its final state, and its log (flow_run_logs)
    once the lines in `expect` have arrived."""
    state = flow_run.result(timeout=timeout_s)
    return state, flow_run_logs(state.state_details.flow_run_id, *expect)
