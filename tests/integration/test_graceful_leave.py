"""A worker asked to leave without a signal in its own process: `Client.retire_workers`, and
SIGTERM to its nanny (what `dask worker` and a Kubernetes pod receive). Both close the worker
through Worker.close / Nanny.close; the group must still checkpoint at its next control step
and resume there with the uninterrupted run's weights.

The workers are real `dask worker` processes (one nanny and one worker process each) against
a scheduler in this process, so that SIGTERM reaches a nanny the way a supervisor sends it. A
worker that left is replaced by a fresh `dask worker`, as a pod or a job would be."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import distributed
import pytest

from ddpflow.cluster import WORKER_ENV, local_cluster
from ddpflow.distributed.supervision import cluster_workers
from infra.dask_service import LOOPBACK_HTTP
from infra.procs import Service, spawn, stop
from infra.runtime import BIN, base_env
from infra.services import free_port, start_prefect_server
from tests.integration.charlm_runs import (
    assert_same_metrics,
    assert_same_weights,
    final_weights,
    finish,
    wait_for_checkpoint,
)
from tests.integration.conftest import REPO
from tests.integration.test_fault_tolerance import (
    assert_completed_once_with_one_restart,
    assert_restart_recorded,
    process_gone,
    resumed_inside_epoch,
    start_flow,
    steps_redone,
)

pytestmark = pytest.mark.integration
CONTROL_EVERY = 20  # fit() reads a stop request every log_every_steps (20) steps
GONE_S = 40.0  # the grace period (25 s) and the close after it


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory) -> Iterator[dict]:
    """A Prefect server and a Dask scheduler without workers: each test starts its own
    `dask worker` processes (`workers`)."""
    home = tmp_path_factory.mktemp("prefect")
    server = start_prefect_server(free_port(), home, home)
    try:
        env = {"PREFECT_API_URL": server.url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        with local_cluster(0) as lc, distributed.Client(lc) as client:
            yield {
                "client": client,
                "address": lc.scheduler_address,
                "env": {**env, "DDPFLOW_DASK_ADDRESS": lc.scheduler_address},
                "worker_env": env,
                "prefect_url": server.url,
                "logs": home / "logs",
            }
    finally:
        stop(server)


class Workers:
    """`dask worker` processes of one test; all are stopped at its end."""

    def __init__(self, scheduler: dict):
        self.scheduler, self.started = scheduler, []

    def start(self) -> Service:
        env = base_env({**self.scheduler["worker_env"], **WORKER_ENV, "PYTHONPATH": str(REPO)})
        argv = [
            str(BIN / "dask"), "worker", self.scheduler["address"], "--nthreads", "1",
            "--host", "127.0.0.1", *LOOPBACK_HTTP,
        ]  # fmt: skip
        service = spawn(f"dask-worker-{len(self.started)}", argv, env, self.scheduler["logs"])
        self.started.append(service)
        return service

    def of_rank(self, rank: int) -> tuple[str, Service]:
        """The worker address of `rank` (ranks are planned in address order) and the
        `dask worker` process, its nanny's, that runs it."""
        client = self.scheduler["client"]
        parents = client.run(os.getppid)  # a worker process's parent is its nanny's process
        address = sorted(parents)[rank]
        (service,) = [s for s in self.started if s.pid == parents[address]]
        return address, service


@pytest.fixture
def workers(scheduler) -> Iterator[Workers]:
    started = Workers(scheduler)
    for _ in range(2):
        started.start()
    try:
        scheduler["client"].wait_for_workers(2, timeout=120)
        yield started
    finally:
        for service in started.started:
            stop(service)
        deadline = time.monotonic() + 30  # the next test starts from no workers
        while cluster_workers(scheduler["client"]) and time.monotonic() < deadline:
            time.sleep(0.2)


def step_checkpoint_after(project: Path, since: float, timeout_s: float = GONE_S) -> Path:
    """The first checkpoint inside epoch 2 (epoch-0001.step-*.pt), and when it appeared."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(project.glob("artifacts/runs/*/checkpoints/epoch-0001.step-*.pt"))
        if found:
            print(f"{found[0].name} appeared {time.monotonic() - since:.1f} s after the request")
            return found[0]
        time.sleep(0.05)
    raise AssertionError("no checkpoint inside epoch 2 after the request to leave")


def assert_resumed_at_the_stop(output: str, checkpoint: Path, cluster: dict) -> None:
    epoch, step, steps_per_epoch = resumed_inside_epoch(output)
    print(f"resumed at epoch {epoch} step {step}/{steps_per_epoch}")
    assert epoch == 2 and step > 0 and step % CONTROL_EVERY == 0, (epoch, step)
    assert checkpoint.name == f"epoch-0001.step-{step:08d}.pt", "resumed from the stop's step"
    redone = steps_redone(cluster["client"])
    print(f"{redone} steps redone")
    assert redone == 0, "the group stopped at its checkpoint's step"


def start_training(project: Path, cluster: dict) -> subprocess.Popen[str]:
    proc = start_flow(project, cluster)  # defaults: no step checkpoint before the stop
    wait_for_checkpoint(project, 1, proc)
    time.sleep(0.5)  # into epoch 2
    return proc


# docs/fault-tolerance.md: `retire_workers` makes the group checkpoint at its next control step,
# the relaunch (on a fresh worker) resumes at that step, with the uninterrupted run's weights.
def test_retire_workers_checkpoints_at_the_next_step_and_resumes_there(
    scheduler, workers, charlm_reference, charlm_reference_project, tmp_path
):
    cluster = scheduler
    proc = start_training(tmp_path, cluster)
    address, service = workers.of_rank(1)
    asked = time.monotonic()
    retired = cluster["client"].retire_workers([address])
    assert address in retired, retired
    checkpoint = step_checkpoint_after(tmp_path, asked)
    assert process_gone(service.pid, GONE_S), "the retired worker's `dask worker` did not exit"
    print(f"its `dask worker` exited {time.monotonic() - asked:.1f} s after retire_workers")
    workers.start()  # a replacement, as an autoscaler or a job queue would start
    code, output = finish(proc)
    assert code == 0, output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    cause, _ = assert_restart_recorded(cluster, tmp_path)
    assert f"worker {address} asked to stop (its worker is closing" in cause, cause
    assert_resumed_at_the_stop(output, checkpoint, cluster)
    assert_same_weights(final_weights(tmp_path), charlm_reference)
    assert_same_metrics(tmp_path, charlm_reference_project)


# docs/fault-tolerance.md: SIGTERM to a `dask worker` (its nanny) makes the group checkpoint at
# its next control step before the nanny closes its worker. Rank 0 runs there: the checkpoint
# is written by the process that is leaving.
def test_sigterm_to_a_nanny_checkpoints_at_the_next_step_and_resumes_there(
    scheduler, workers, charlm_reference, charlm_reference_project, tmp_path
):
    cluster = scheduler
    proc = start_training(tmp_path, cluster)
    address, service = workers.of_rank(0)
    asked = time.monotonic()
    os.kill(service.pid, signal.SIGTERM)
    checkpoint = step_checkpoint_after(tmp_path, asked)
    assert process_gone(service.pid, GONE_S), "`dask worker` did not exit on SIGTERM"
    print(f"`dask worker` exited {time.monotonic() - asked:.1f} s after SIGTERM")
    workers.start()  # a replacement, as Kubernetes starts a new pod
    code, output = finish(proc)
    assert code == 0, output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    cause, _ = assert_restart_recorded(cluster, tmp_path)
    assert f"worker {address} asked to stop (its nanny is closing" in cause, cause
    assert_resumed_at_the_stop(output, checkpoint, cluster)
    assert_same_weights(final_weights(tmp_path), charlm_reference)
    assert_same_metrics(tmp_path, charlm_reference_project)
