"""DDPFLOW_CLUSTER=jobqueue on a real Slurm cluster (one node, see slurm_cluster.py): the
flow submits its Dask workers as Slurm jobs and trains across them over TLS with credentials
made for the run, which another local user can neither connect to nor join with a worker of
their own; and a worker job cancelled mid-run (scancel) is replaced by a new job and costs
exactly one restart.

The flow runs in a thread of this process (its jobqueue cluster's scheduler with it), against
a Prefect API of the module's that the worker jobs reach too; its log is read back from it."""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import logging
import re
import signal
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from flows.params import CharLMParams
from flows.train_charlm import train_charlm
from tests.helpers.charlm_runs import (
    TINY_PARAMS,
    assert_completed_once_with_one_restart,
    the_run,
    wait_for_checkpoint,
)
from tests.helpers.in_process import finish_in_process, start_in_process
from tests.helpers.paths import CHECKOUT
from tests.helpers.slurm_cluster import Slurm
from tests.helpers.stranger_worker import StrangerWorker, plain_tcp_client, require_stranger

pytestmark = [pytest.mark.integration, pytest.mark.slurm]


def _import_jobqueue_here() -> None:
    """Import dask_jobqueue in the main thread, keeping pytest's Ctrl-C handler: importing
    it sets a SIGINT handler, which only the main thread may do, and the flow (which imports
    it to build its cluster) runs in another thread."""
    handler = signal.getsignal(signal.SIGINT)
    importlib.import_module("dask_jobqueue")
    signal.signal(signal.SIGINT, handler)


_import_jobqueue_here()
JOBS_TIMEOUT_S = 120
REGISTERED = re.compile(r"^(\S+ \S+) - distributed\.worker - INFO - +Registered to:", re.M)
TLS_FOLDERS = ".ddpflow-dask-tls-*"


def job_name(project: Path) -> str:
    return f"ddpflow-{project.name}"[:60]


def start_flow(
    project: Path, slurm: Slurm, api_url: str, monkeypatch, **overrides: object
) -> concurrent.futures.Future:
    """The tiny training (TINY_PARAMS with `overrides`) in a thread, on 2 workers, each one
    Slurm job of 1 core. Slurm hands the jobs the environment they were submitted from,
    PREFECT_API_URL included (a flow's ephemeral API is not handed to batch-queue workers)."""
    options = {
        "system": "slurm",
        "n_workers": 2,
        "cores": 1,
        "memory": "4GB",
        "processes": 1,
        "python": sys.executable,
        "queue": slurm.partition,
        "walltime": "00:30:00",
        "job_name": job_name(project),
        "log_directory": str(project / "slurm-logs"),
        # Where the run's TLS credentials folder goes (the home folder by default).
        "shared_temp_directory": str(project),
        "job_script_prologue": [f"export PYTHONPATH={CHECKOUT}"],
        "wait_for_workers_s": JOBS_TIMEOUT_S,
    }
    env = {
        "SLURM_CONF": str(slurm.conf),
        "PREFECT_API_URL": api_url,
        "DDPFLOW_CLUSTER": "jobqueue",
        "DDPFLOW_CLUSTER_OPTIONS": json.dumps(options),
        # Each job's worker logs its registration at INFO (registered_at reads it). A
        # LocalCluster started earlier in this process leaves DASK_LOGGING__DISTRIBUTED=warning
        # in its environment (distributed applies a nanny's pre-spawn environment to its own
        # process), which the jobs would inherit.
        "DASK_LOGGING__DISTRIBUTED": "info",
    }
    training = CharLMParams(**{**TINY_PARAMS, **overrides})
    return start_in_process(train_charlm, project, None, monkeypatch, env, training=training)


def running_jobs(
    slurm: Slurm, project: Path, count: int, flow_run: concurrent.futures.Future
) -> set[str]:
    """Wait until `count` of the flow's worker jobs are RUNNING in Slurm; their ids."""
    deadline = time.monotonic() + JOBS_TIMEOUT_S
    while True:
        jobs = slurm.jobs(job_name(project))
        running = {job for job, state in jobs.items() if state == "RUNNING"}
        if len(running) >= count:
            return running
        assert not flow_run.done(), f"the flow ended first: {flow_run.result()}"
        assert time.monotonic() < deadline, f"jobs {jobs}, not {count} running"
        time.sleep(0.5)


def worker_logs(project: Path) -> dict[str, str]:
    """Job id -> the stderr of the Dask worker that Slurm ran for that job."""
    logs = (project / "slurm-logs").glob(f"{job_name(project)}-*.err")
    return {path.stem.rsplit("-", 1)[1]: path.read_text() for path in logs}


def registered_at(log: str) -> datetime:
    found = REGISTERED.search(log)
    assert found, f"the job's worker never registered with the flow's scheduler:\n{log[-2000:]}"
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")


def assert_no_job_left(slurm: Slurm, project: Path) -> None:
    """The flow's cluster cancelled its jobs when the run ended (a cancelled job may show
    COMPLETING for a moment while Slurm reaps it)."""
    jobs = slurm.jobs(job_name(project))
    assert not {j: s for j, s in jobs.items() if s in ("PENDING", "RUNNING")}, jobs
    deadline = time.monotonic() + 30
    while jobs and time.monotonic() < deadline:
        time.sleep(0.5)
        jobs = slurm.jobs(job_name(project))
    assert not jobs, jobs


class SchedulerLog(logging.Handler):
    """The INFO lines of the schedulers that run in this process (the flow's, here)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def address(self) -> str:
        (address,) = [line.split()[-1] for line in self.lines if "Scheduler at:" in line]
        return address

    def registered(self) -> list[str]:
        """The name of every worker that registered, in order."""
        found = (re.search(r"Register worker addr: \S+ name: (\S+)", x) for x in self.lines)
        return [m.group(1) for m in found if m]


@contextmanager
def scheduler_log() -> Iterator[SchedulerLog]:
    logger = logging.getLogger("distributed.scheduler")
    handler, level = SchedulerLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def assert_credentials_private(slurm: Slurm, jobs: set[str]) -> None:
    """Each job's script, as Slurm keeps it, and its worker's command line and environment
    name the run's TLS files but hold no key; the files lie in a 0700 folder, each 0600."""
    folders = set()
    for job in jobs:
        script = slurm.run("scontrol", "write", "batch_script", job, "-")
        assert "PRIVATE KEY" not in script and "BEGIN CERTIFICATE" not in script
        worker = script.strip().splitlines()[-1].split()
        assert worker[3].startswith("tls://"), worker
        files = [Path(worker[worker.index(flag) + 1]) for flag in ("--tls-cert", "--tls-key")]
        assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}, files
        folders |= {f.parent for f in files}
    (folder,) = folders
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    workers = [
        p for p in psutil.process_iter(["cmdline"])
        if "distributed.cli.dask_worker" in (p.info["cmdline"] or [])
        and any(str(folder) in arg for arg in p.info["cmdline"])
    ]  # fmt: skip
    assert len(workers) == len(jobs), "the jobs' workers are not in the process list"
    for proc in workers:
        for part in ("cmdline", "environ"):
            assert b"PRIVATE KEY" not in Path(f"/proc/{proc.pid}/{part}").read_bytes(), part


def wait_for_attempt(stranger: StrangerWorker, flow_run: concurrent.futures.Future) -> None:
    """Until the stranger's worker has tried the scheduler (refused or joined), which must
    happen while the flow's cluster is up: a try after it closed would prove nothing."""
    deadline = time.monotonic() + 60
    while not re.search(r"Waiting to connect to|Registered to", stranger.text()):
        assert stranger.proc.poll() is None, stranger.text()[-2000:]
        assert time.monotonic() < deadline, stranger.text()[-2000:]
        time.sleep(0.2)
    assert not flow_run.done(), "the stranger's worker tried only after the flow ended"


def test_train_charlm_on_two_slurm_worker_jobs(slurm, prefect_api_url, tmp_path, monkeypatch):
    """Two ranks train across two Slurm jobs, on a scheduler that is tls:// only: a plain
    tcp:// client of another local user (`nobody`) is refused, and that user's own `dask
    worker` never joins, so it never becomes a rank. The run's credentials are private to
    the jobs' user and gone when the cluster closes."""
    require_stranger()
    stranger = None
    with scheduler_log() as scheduler:
        flow_run = start_flow(tmp_path, slurm, prefect_api_url, monkeypatch, epochs=2)
        try:
            jobs = running_jobs(slurm, tmp_path, 2, flow_run)
            address = scheduler.address()
            assert address.startswith("tls://"), address
            plain = "tcp://" + address.split("://", 1)[1]
            stranger = StrangerWorker(plain)
            refused = plain_tcp_client(plain)
            assert refused.startswith("refused"), refused
            assert_credentials_private(slurm, jobs)
            wait_for_attempt(stranger, flow_run)
            state, output = finish_in_process(flow_run, "world size")
        finally:
            slurm.cancel(job_name(tmp_path))  # a flow still running then fails without workers
            stranger_log = stranger.stop() if stranger else ""
    assert state.is_completed(), f"{state}\n{output[-4000:]}"
    assert re.search(r"world size +2 ranks", output), output[-3000:]
    _, run = the_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    # Exactly the two jobs seen running, and each one's worker joined the flow's scheduler;
    # the stranger's never did, on either side.
    logs = worker_logs(tmp_path)
    assert set(logs) == jobs
    for log in logs.values():
        registered_at(log)
    assert StrangerWorker.NAME not in scheduler.registered(), scheduler.registered()
    assert len(scheduler.registered()) == 2, scheduler.registered()
    assert "Registered to" not in stranger_log, stranger_log[-2000:]
    assert "Waiting to connect to" in stranger_log, stranger_log[-2000:]
    assert not list(tmp_path.glob(TLS_FOLDERS)), "the credentials outlived the cluster"
    assert_no_job_left(slurm, tmp_path)


def test_scancel_of_a_worker_job_is_replaced_and_costs_one_restart(
    slurm, prefect_api_url, tmp_path, monkeypatch
):
    flow_run = start_flow(tmp_path, slurm, prefect_api_url, monkeypatch)
    try:
        first = running_jobs(slurm, tmp_path, 2, flow_run)
        wait_for_checkpoint(tmp_path, 1, flow_run)
        victim = min(first, key=int)
        slurm.run("scancel", victim)
        cancelled_at = datetime.now()
        state, output = finish_in_process(flow_run)
    finally:
        slurm.cancel(job_name(tmp_path))
    assert state.is_completed(), f"{state}\n{output[-4000:]}"
    assert_completed_once_with_one_restart(tmp_path, output)
    _, run = the_run(tmp_path)
    assert run.data.params["world_size"] == "2"
    # A third job replaced the cancelled one, and its worker joined the scheduler.
    logs = worker_logs(tmp_path)
    assert len(logs) == 3 and first < set(logs), sorted(logs)
    (replacement,) = set(logs) - first
    joined_s = (registered_at(logs[replacement]) - cancelled_at).total_seconds()
    print(f"replacement job {replacement} registered {joined_s:.1f} s after scancel {victim}")
    assert_no_job_left(slurm, tmp_path)
