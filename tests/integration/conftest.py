"""Real processes: a Dask LocalCluster with worker processes, flows run as `python -m`."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextvars
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask
import distributed
import pytest
import torch
from mlflow.tracking import MlflowClient

from ddpflow.cluster.build import local_cluster
from ddpflow.integrations.prefect import db_template as prefect_db_template
from ddpflow.tracking.store import template as mlflow_store_template
from tests.integration.charlm_runs import SMALL_SOURCE, TINY, final_weights
from tests.integration.prefect_harness import api_of_this_process, prefect_server
from tests.integration.s3_servers import seaweedfs_server
from tests.integration.session_folder import session_folder
from tests.integration.slurm_cluster import Slurm, slurm_cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dask_client() -> Iterator[distributed.Client]:
    """Two worker processes x one thread, on 127.0.0.1, stopped at the end of the module."""
    with local_cluster(2) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


@pytest.fixture(scope="session")
def shared_prefect_server() -> Iterator[str]:
    """One Prefect API server for this test process (its URL), which the modules use in
    turn: a start costs about 5 CPU-seconds and 5 s on an idle machine. What the tests read
    back from it is selected by flow run (id, the latest of a flow name, an artifact key
    newest first), never "every record", so the runs of a module before do not get in the
    way."""
    with prefect_server(migrated_prefect_db()) as url:
        yield url


@pytest.fixture(scope="module")
def prefect_api_url(shared_prefect_server: str) -> Iterator[str]:
    """A Prefect API for a module whose flows run in this process on clusters of their own
    (flow_services has one with a cluster): its URL, this process's API meanwhile."""
    with api_of_this_process(shared_prefect_server) as url:
        yield url


@pytest.fixture(scope="module")
def flow_services_env() -> dict[str, str]:
    """Environment of flow_services' worker processes and of this process while they run
    (a module overrides it, e.g. with an S3 endpoint and its keys)."""
    return {}


@pytest.fixture(scope="module")
def flow_services(flow_services_env: dict[str, str], shared_prefect_server: str) -> Iterator[str]:
    """What `python -m flows.<name>` starts for each run, started once for a module whose
    flows run in the test's own process (run_in_process): a Prefect API and a Dask cluster
    of two worker processes (plain tcp on 127.0.0.1). Yields the scheduler's address.

    The workers run with flow_services_env, as workers started in that environment would:
    its DASK_* variables are Dask configuration too, which a nanny hands its worker (e.g. a
    worker preload)."""
    with (
        pytest.MonkeyPatch.context() as patch,
        dask.config.set(_dotted(dask.config.collect_env(flow_services_env))),
        api_of_this_process(shared_prefect_server),
        local_cluster(2, env=flow_services_env, tls=False) as cluster,
    ):
        for name, value in flow_services_env.items():
            patch.setenv(name, value)
        yield cluster.scheduler_address


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


def latest_flow_run(flow_name: str) -> Any:
    """The flow's last run in the API (flow_services')."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=1,
        )
    assert runs, f"no run of {flow_name} recorded"
    return runs[0]


def flow_run_records(flow_run_id: Any) -> dict:
    """The flow run, its task runs (states and their messages), logs and artifacts as the
    API (flow_services') holds them, in the shape prefect_records gives a project's
    database."""
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


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} as {"a.b": 1}: dask.config.set replaces a whole subtree it is given."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_dotted(value, f"{prefix}{key}."))
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


@pytest.fixture(scope="module")
def s3_endpoint(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[str]:
    """A SeaweedFS S3 server for the module (its URL), with the bucket its BUCKET constant
    names; the tests' keys (s3_env) are its administrator's. One per module rather than one
    per test process: an idle server costs more CPU over a run than the starts it would
    save (docs/testing.md "S3 in the tests")."""
    buckets = (request.module.BUCKET,) if hasattr(request.module, "BUCKET") else ()
    with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs"), buckets) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[Slurm]:
    """A one-node Slurm cluster (munged, slurmctld, slurmd), installed with apt-get if
    missing; `slurm.conf` is its SLURM_CONF. Skips outside CI where it cannot run (not root,
    no apt-get); fails on CI (CI=true). Every job and daemon is stopped at the end."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@functools.cache
def migrated_prefect_db() -> Path:
    """A Prefect database with every migration applied: the one `make venv` installs
    (ddpflow/integrations/prefect/db_template.py), else one made once per test session.

    A flow run without PREFECT_API_URL starts Prefect's embedded API, which on a fresh
    database first runs every migration: about 15 s of each flow run's start on a loaded
    2-core machine. Each project gets a copy of this one, so its runs skip that and stay
    isolated from every other test's.
    """
    installed = prefect_db_template.template_path()
    if installed is not None and installed.is_file():
        return installed
    folder = Path(tempfile.mkdtemp(prefix="ddpflow-prefect-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return prefect_db_template.build(folder / "prefect.db")


@functools.cache
def migrated_mlflow_db() -> Path:
    """An MLflow SQLite store with its tracking and registry schema: the one `make venv`
    installs (ddpflow/tracking/store/template.py), else one made once per test session.

    A training's first MLflow call on a fresh store runs every migration: about 4 s of each
    training flow on a loaded 2-core machine. Each project gets a copy of this empty store
    (tests/integration/test_sqlite_store.py creates fresh ones on purpose).
    """
    installed = mlflow_store_template.template_path()
    if installed is not None and installed.is_file():
        return installed
    folder = Path(tempfile.mkdtemp(prefix="ddpflow-mlflow-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return mlflow_store_template.build(folder / "mlflow.db")


def project_env(project: Path, first_project: bool = False) -> dict[str, str]:
    """An isolated project: its own artifact folder, MLflow SQLite file and Prefect home,
    both databases starting migrated and empty (a file already there is kept). With
    `first_project` neither database is there, as in a user's first project: the flow's own
    start makes them (from the installed templates, where `make venv` built them)."""
    templates = [
        (project / "mlflow.db", migrated_mlflow_db),
        (project / ".prefect" / "prefect.db", migrated_prefect_db),
    ]
    for database, template in templates:
        if not first_project and not database.exists():
            database.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(template(), database)
    # DASK_* too: a nanny in this test process (a LocalCluster fixture) copies its
    # pre-spawn variables into this process's environment, e.g. quiet worker logging.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DASK_"))
    }
    env.update(
        {
            "DDPFLOW_ARTIFACT_ROOT": str(project / "artifacts"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
            "PREFECT_HOME": str(project / ".prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # The first start on a fresh database (migrations) can take longer than the
            # ephemeral API's default 20 s limit on a loaded machine.
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
            "PYTHONPATH": str(REPO),
        }
    )
    env.pop("DDPFLOW_DASK_ADDRESS", None)
    return env


def tiny_charlm_params(
    epochs: int, source: str | None = SMALL_SOURCE, **overrides: object
) -> dict[str, object]:
    """A pet-name training small enough for a test, as the flow's parameter model takes it:
    one LSTM layer of 16, batches of 4096, on the first third of the shipped names
    (source=None: no source, the flow's default, all of them); `overrides` (e.g.
    keep_last=2) add or replace fields."""
    sizes = {"epochs": epochs, "hidden_size": 16, "num_layers": 1, "batch_size": 4096}
    return {**({"source": source} if source else {}), **sizes, **overrides}


def tiny_charlm(epochs: int, **overrides: object) -> list[str]:
    """tiny_charlm_params as command-line options."""
    options = tiny_charlm_params(epochs, **overrides)
    return [item for k, v in options.items() for item in (f"--{k.replace('_', '-')}", str(v))]


def project_tracking(project: Path) -> MlflowClient:
    """An MLflow client on the project's own SQLite store (project_env's)."""
    return MlflowClient(f"sqlite:///{project / 'mlflow.db'}")


def prefect_cli(
    project: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    """`prefect ARGS...` on the project's Prefect database, e.g. ("flow-run", "inspect", id)."""
    return run_in_project([sys.executable, "-m", "prefect", *args], project, env, timeout_s)


def run_in_project(
    argv: list[str],
    project: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    first_project: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`argv` in the project folder with its isolated environment (project_env) plus `env`;
    output captured, the exit code left to the caller."""
    return subprocess.run(
        argv,
        cwd=project,
        env={**project_env(project, first_project), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


# Prefect's records read back through its client (the API, not the database file).
READ_RECORDS = """
import json
from prefect.client.orchestration import get_client

with get_client(sync_client=True) as client:
    records = {
        "flow_runs": [r.model_dump(mode="json") for r in client.read_flow_runs()],
        "task_runs": [r.model_dump(mode="json") for r in client.read_task_runs()],
        "logs": [r.model_dump(mode="json") for r in client.read_logs()],
        "artifacts": [r.model_dump(mode="json") for r in client.read_artifacts()],
    }
print(json.dumps(records))
"""


def prefect_records(project: Path) -> dict:
    """Every flow run, task run (with its state and message), log and artifact in the
    project's Prefect database."""
    result = run_in_project([sys.executable, "-c", READ_RECORDS], project, timeout_s=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_flow(
    module: str,
    args: list[str],
    project: Path,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
    first_project: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m flows.<module> ...` the way a user does, in the project folder
    (`first_project`: see project_env)."""
    project.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", f"flows.{module}", *args]
    return run_in_project(argv, project, env, timeout_s, first_project)


@pytest.fixture(scope="session")
def charlm_reference_project(tmp_path_factory) -> Path:
    """The project folder of an uninterrupted tiny 2-rank training on the laptop default (a
    LocalCluster): its checkpoints and its MLflow run are what exact resumes reproduce.
    Trained once per session, for the fault, multi-host and graceful-leave modules on
    whichever processes they run (session_folder); they only read it."""

    def train(project: Path) -> None:
        result = run_flow("train_charlm", TINY, project, timeout_s=400)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    return session_folder(tmp_path_factory, "charlm-reference", train)


@pytest.fixture(scope="session")
def charlm_reference(charlm_reference_project: Path) -> dict[str, torch.Tensor]:
    """Final weights of the uninterrupted run, which every exact-resume and multi-host test
    must reproduce bitwise."""
    return final_weights(charlm_reference_project)
