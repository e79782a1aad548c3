"""A flow on a Dask cluster it did not start: a real `dask scheduler` and `dask worker
--nworkers 2`, started as a user starts them, with no Prefect setting of their own.

Every Prefect task run must land in the flow's API (the embedded one, or a server set only on
the flow's side), and once the flow and the workers have ended no process of theirs may
remain. Each process the test starts carries a unique environment variable that its children
inherit, so leftovers are found by that mark, not confused with other users' processes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import distributed
import psutil
import pytest
from mlflow.tracking import MlflowClient

from ddpflow.tracking.run import default_artifact_location
from flows.params import CharLMParams
from flows.train_charlm import train_charlm
from infra.procs import Service, pid_alive
from infra.services import free_port, start_dask, stop
from tasks.registration import IN_PROCESS_FAILURE_TAG
from tests.helpers.charlm_runs import SMALL_SOURCE, TINY_PARAMS
from tests.helpers.in_process import start_in_process
from tests.helpers.paths import CHECKOUT
from tests.helpers.prefect_harness import api_of_this_process
from tests.helpers.prefect_reads import flow_run_task_runs
from tests.helpers.projects import prefect_records, project_tracking, run_flow

pytestmark = pytest.mark.integration
MARK_ENV = "DDPFLOW_TEST_PROCESS_MARK"
# Prefect gives its embedded server 20 s to start; on 2 shared, busy cores that can be short.
SLOW_START = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90"}
TINY = [
    "--source",
    SMALL_SOURCE,
    "--epochs",
    "1",
    "--hidden-size",
    "16",
    "--num-layers",
    "1",
    "--batch-size",
    "1024",
    "--num-names",
    "2",
]
# The flow's Prefect tasks: download, format, evaluate and register run on the workers;
# train-ddp runs in the flow process and launches the ranks from there.
TASKS = {"download-corpus", "format-corpus", "train-ddp", "evaluate", "register-model"}
# Dask's profiler, on as in a plain `dask worker` (ddpflow's own workers run without it), and
# also sampling a hundred times as often as its default.
PROFILER_ON = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "True"}
PROFILER_EVERY_01_MS = {**PROFILER_ON, "DASK_DISTRIBUTED__WORKER__PROFILE__INTERVAL": "0.1ms"}


def marked(mark: str) -> list[psutil.Process]:
    """Live processes that carry the mark, whoever their parent is now (orphans too)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK_ENV) == mark:
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


def describe(procs: list[psutil.Process]) -> list[str]:
    described = []
    for proc in procs:
        try:
            described.append(f"{proc.pid} (ppid {proc.ppid()}): {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            continue
    return described


def api_servers(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The Prefect API servers among procs (the temporary one runs uvicorn on create_app)."""

    def is_server(proc: psutil.Process) -> bool:
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            return False
        return "prefect.server" in line or "uvicorn" in line

    return [proc for proc in procs if is_server(proc)]


def assert_none_left(mark: str, timeout_s: float = 10) -> None:
    """Bounded: a process that is ending gets a few seconds to go."""
    deadline = time.monotonic() + timeout_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "processes left behind:\n" + "\n".join(describe(left))


@contextmanager
def external_dask(tmp_path: Path, mark: str, **extra_env: str) -> Iterator[tuple[Service, Service]]:
    """`dask scheduler` + `dask worker --nworkers 2 --nthreads 1` on 127.0.0.1, each in its
    own session, without PREFECT_API_URL; both are stopped (the whole group) at the end,
    also when the test ended them itself (then that finds nothing left to stop)."""
    env = {
        "PYTHONPATH": str(CHECKOUT),
        "PREFECT_HOME": str(tmp_path / "worker-prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        MARK_ENV: mark,
        **extra_env,
    }
    scheduler, workers = start_dask(free_port(), 2, env, tmp_path / "logs", tmp_path / "scratch")
    try:
        yield scheduler, workers
    finally:
        stop(workers)
        stop(scheduler)


def end_like_a_user(*services: Service, timeout_s: float = 30) -> None:
    """SIGTERM to each leader only, as a user or a supervisor stops `dask worker`: whatever
    its worker processes started and did not stop themselves is orphaned, not killed."""
    for service in services:
        os.kill(service.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(service.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pid_alive(service.pid), f"{service.name} did not exit on SIGTERM"


def task_runs(project: Path) -> list[dict]:
    """The flow runs and their task runs as the flow's embedded API stored them."""
    records = prefect_records(project)
    return [
        {
            "state": run["state_type"],
            "tasks": [
                [task["name"], task["state_type"]]
                for task in records["task_runs"]
                if task["flow_run_id"] == run["id"]
            ],
        }
        for run in records["flow_runs"]
    ]


def assert_all_tasks_completed(runs: list[dict], output: str) -> None:
    assert len(runs) == 1, runs
    assert runs[0]["state"] == "COMPLETED", runs
    states = {name.rsplit("-", 1)[0]: state for name, state in runs[0]["tasks"]}
    assert states.keys() >= TASKS, f"task runs missing from the flow's API: {runs}\n{output}"
    assert all(state == "COMPLETED" for state in states.values()), states


def train_on(address: str, project: Path, mark: str, **env: str) -> str:
    result = run_flow(
        "train_charlm",
        TINY,
        project,
        timeout_s=300,
        env={"DDPFLOW_DASK_ADDRESS": address, MARK_ENV: mark, **SLOW_START, **env},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    return output


@pytest.mark.timeout(420)
def test_embedded_api_gets_every_task_run_and_nothing_is_left(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    project = tmp_path / "project"
    with external_dask(tmp_path, mark) as (scheduler, workers):
        output = train_on(scheduler.url, project, mark)
        # The flow's own embedded server stopped when the flow exited; a temporary server
        # started by a worker would still run beside it.
        servers = api_servers(marked(mark))
        assert not servers, "API servers after the flow ended:\n" + "\n".join(describe(servers))
        log = workers.log_path.read_text(errors="replace")
        assert "Starting temporary server" not in log, log[-3000:]
        end_like_a_user(workers, scheduler)
        assert_none_left(mark)  # before the fixture's group kill could hide an orphan
    assert_all_tasks_completed(task_runs(project), output)


@pytest.mark.timeout(300)
def test_preflight_stops_a_flow_whose_workers_cannot_reach_its_api(tmp_path: Path) -> None:
    """The workers reach nothing over HTTP (their proxy is a closed port), as workers on
    another host cannot reach the embedded API: pre-flight says so, before any work."""
    mark = uuid.uuid4().hex
    project = tmp_path / "project"
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    cut_off = {"http_proxy": dead_proxy, "HTTP_PROXY": dead_proxy, "no_proxy": "", "NO_PROXY": ""}
    with external_dask(tmp_path, mark, **cut_off) as (scheduler, _):
        result = run_flow(
            "train_charlm",
            TINY,
            project,
            timeout_s=240,
            env={"DDPFLOW_DASK_ADDRESS": scheduler.url, MARK_ENV: mark, **SLOW_START},
        )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "2 of 2 Dask workers cannot reach the flow's embedded Prefect API" in output, output
    assert "prefect server start --host 0.0.0.0" in output and "PREFECT_API_URL" in output
    assert not project_tracking(project).search_experiments(filter_string="name != 'Default'"), (
        "pre-flight failed before any MLflow run"
    )
    assert not (project / "artifacts").exists(), "nothing was downloaded"
    assert_none_left(mark)


def test_preflight_stops_a_flow_on_a_cluster_that_cannot_import_the_checkout(
    tmp_path: Path,
) -> None:
    """Scheduler and workers started without the checkout on PYTHONPATH: the check names
    each of them and the fix, instead of Dask's "No module named 'flows'" at the first task."""
    from ddpflow.preflight.checks import PreflightError
    from flows.preflight import check_cluster_imports_project

    with (
        external_dask(tmp_path, uuid.uuid4().hex, PYTHONPATH="") as (scheduler, _),
        distributed.Client(scheduler.url, timeout=10) as client,
    ):
        names = sorted(client.scheduler_info()["workers"])
        with pytest.raises(PreflightError) as info:
            check_cluster_imports_project(client)
    message = str(info.value)
    assert "3 of 3 Dask processes" in message, message
    assert all(name in message for name in [*names, "the scheduler"]), message
    assert "No module named 'flows'" in message and "PYTHONPATH" in message
    assert "docs/multi-host.md" in message


@dataclass
class PlainDask:
    """A `dask worker --nworkers 2` with Dask's profiler on, as a user starts it, and the
    mark its processes carry."""

    scheduler: Service
    mark: str


@pytest.fixture(scope="module")
def plain_dask(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainDask]:
    """One plain cluster for the module's tests that need the checkout importable and no
    other setting (the probe, then the trainings in a row, which kill a worker last): a
    cluster start is a scheduler, a worker process, its forkserver's imports and two
    workers, about 15 CPU-seconds on these 2 cores."""
    mark = uuid.uuid4().hex
    with external_dask(tmp_path_factory.mktemp("plain-dask"), mark, **PROFILER_ON) as (
        scheduler,
        _,
    ):
        yield PlainDask(scheduler, mark)


def test_worker_probe_names_each_worker_and_is_bounded(plain_dask: PlainDask) -> None:
    """The check itself on real workers: a closed port fails within seconds, naming both."""
    from ddpflow.preflight.checks import PreflightError
    from flows.preflight import check_cluster_imports_project, check_workers_reach_flow_api

    closed = f"http://127.0.0.1:{free_port()}/api"
    with distributed.Client(plain_dask.scheduler.url, timeout=10) as client:
        client.wait_for_workers(2, timeout=120)
        names = sorted(client.scheduler_info()["workers"])
        check_cluster_imports_project(client)  # with the checkout on PYTHONPATH: passes
        started = time.monotonic()
        with pytest.raises(PreflightError) as info:
            check_workers_reach_flow_api(client, closed, timeout_s=3)
        elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < 5, f"the probe took {elapsed:.1f}s"
    assert f"Prefect API {closed}" in message and f"GET {closed}/health" in message
    assert all(name in message for name in names), message
    assert "prefect server start --host 0.0.0.0" in message


def checkpoints_of_epoch_1(project: Path) -> int:
    return len(list(project.glob("artifacts/runs/*/checkpoints/epoch-0001.pt")))


def test_registrations_on_a_worker_whose_profiler_samples_each_register(tmp_path: Path) -> None:
    """Ten registrations in a row on a real `dask worker` with Dask's profiler on, as a plain
    `dask worker` has it, sampling every 0.1 ms (its default: 10 ms), and the worker's GIL
    switch interval at 20 us (Python's: 5 ms), so that the profiler's samples land inside
    torch.export's trace often. Without the profiler paused for the export, 11 of 20 such
    registrations failed with "a fake tensor in the exported program constant's list" (ten
    in a row all pass with a chance of about 3e-4); each must register."""
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = MlflowClient(tracking_uri)
    # The models beside the store: MLflow's default is ./mlruns of the worker's working
    # directory, the checkout.
    location = default_artifact_location(tracking_uri, tmp_path)
    experiment = tracking.create_experiment("profiled-worker", location)
    run_ids = [tracking.create_run(experiment).info.run_id for _ in range(10)]

    def register(run_id: str) -> str:  # runs in the worker's task thread, as register-model
        import numpy as np

        from ddpflow.registry.serving import LogitsOnly
        from ddpflow.tracking.loggers import RunRef
        from ddpflow.tracking.run import register_pt2_model
        from ddpflow.workloads.charlm.config import CharLSTMConfig
        from ddpflow.workloads.charlm.model import CharLSTM

        sys.setswitchinterval(2e-5)
        model = LogitsOnly(CharLSTM(CharLSTMConfig(hidden_size=32, num_layers=2))).eval()
        example = np.zeros((2, 8), dtype=np.int64)
        quiet = [{"message": ".*were assigned during export.*"}]
        return register_pt2_model(RunRef(tracking_uri, run_id), model, example, "hi", quiet)

    def profiler_running(dask_worker: distributed.Worker) -> bool:
        return dask_worker.periodic_callbacks["profile"].is_running()

    with (
        external_dask(tmp_path, uuid.uuid4().hex, **PROFILER_EVERY_01_MS) as (scheduler, _),
        distributed.Client(scheduler.url, timeout=30) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        versions = [client.submit(register, run_id, pure=False).result() for run_id in run_ids]
        # Paused for the export only: the workers' profilers run again.
        assert all(client.run(profiler_running).values())
    assert versions == [str(number) for number in range(1, 11)]


@pytest.mark.timeout(900)
def test_trainings_in_a_row_on_the_same_workers_each_register_a_version(
    plain_dask: PlainDask,
    shared_prefect_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two trainings in a row on one plain `dask worker --nworkers 2` (spawned worker
    processes, Dask's profiler on), the first with a worker SIGKILLed after its first epoch,
    the second on the survivor and the nanny's new worker: each registers its model version,
    in the worker's process (the profiler that made torch.export fail there is paused for the
    export), with no fresh-process fallback needed. The flows run in this process, on a
    Prefect server set on the flow's side only (a test API as this process's): the workers,
    which have no Prefect setting, are handed its URL with each task, and every task run of
    each flow must be in it, with no server started on a worker."""
    mark, scheduler = plain_dask.mark, plain_dask.scheduler
    project = tmp_path / "project"
    project.mkdir()
    states = []
    with (
        api_of_this_process(shared_prefect_server),
        distributed.Client(scheduler.url, timeout=30) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        for kill in (True, False):
            before = checkpoints_of_epoch_1(project)
            # Two epochs: the kill lands after the first, the relaunch trains the second.
            training = CharLMParams(**{**TINY_PARAMS, "epochs": 2})
            flow_run = start_in_process(
                train_charlm, project, scheduler.url, monkeypatch, training=training
            )
            if kill:
                deadline = time.monotonic() + 300
                while checkpoints_of_epoch_1(project) == before:
                    assert not flow_run.done(), flow_run.result()
                    assert time.monotonic() < deadline, "no checkpoint of epoch 1"
                    time.sleep(0.1)
                os.kill(max(client.run(os.getpid).values()), signal.SIGKILL)
            state = flow_run.result(timeout=400)
            states.append(state)
            assert state.is_completed(), state
            client.wait_for_workers(2, timeout=120)  # the nanny replaced the killed one
        servers = api_servers(marked(mark))
        assert not servers, "API servers on the workers:\n" + "\n".join(describe(servers))
        for state in states:
            found = flow_run_task_runs(state.state_details.flow_run_id)
            tasks = [[t.name, t.state_type.value] for t in found]
            assert_all_tasks_completed([{"state": state.type.value, "tasks": tasks}], str(state))
    tracking = project_tracking(project)
    versions = tracking.search_model_versions("name = 'ddpflow-charlm'")
    assert len(versions) == 2, [v.version for v in versions]
    trainings = [tracking.get_run(run_id) for run_id in {v.run_id for v in versions}]
    assert len(trainings) == 2, "one version per training"
    assert all(run.info.status == "FINISHED" for run in trainings)
    restarts = sorted(run.data.tags.get("ddpflow.restarts", "0") for run in trainings)
    assert restarts == ["0", "1"], states
    assert not any("ddpflow.registration_failed" in run.data.tags for run in trainings)
    failed_in_worker = [run.data.tags.get(IN_PROCESS_FAILURE_TAG) for run in trainings]
    assert failed_in_worker == [None, None], failed_in_worker
