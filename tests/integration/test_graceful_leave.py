"""A worker asked to leave without a signal in its own process: `Client.retire_workers`, and
SIGTERM to its nanny (what `dask worker` and a Kubernetes pod receive). Both close the worker
through Worker.close / Nanny.close; the group must still checkpoint at its next control step
and resume there with the uninterrupted run's weights.

The workers are real `dask worker` processes (one nanny and one worker process each) against
a scheduler in this process, so that SIGTERM reaches a nanny the way a supervisor sends it. A
worker that left is replaced by a fresh `dask worker`, as a pod or a job would be. The flow
runs in a thread of this process, against a Prefect API of this module's, and is read back
through that API (its log, its artifacts)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import distributed
import psutil
import pytest

from ddpflow.cluster.build import local_cluster
from ddpflow.cluster.workers import WORKER_CLI_ARGS, WORKER_ENV
from ddpflow.distributed.supervisor.watch import cluster_workers
from flows.params import CharLMParams
from flows.train_charlm import train_charlm
from infra.dask_service import LOOPBACK_HTTP
from infra.procs import Service, spawn, stop
from infra.runtime import BIN, base_env
from tests.helpers.charlm_runs import (
    EPOCHS,
    TINY_PARAMS,
    assert_same_metrics,
    assert_same_weights,
    final_weights,
    metric_points,
    process_gone,
    restart_rows,
    the_run,
    wait_for_checkpoint,
)
from tests.helpers.in_process import finish_in_process, start_in_process
from tests.helpers.paths import CHECKOUT

pytestmark = pytest.mark.integration
CONTROL_EVERY = 20  # fit() reads a stop request every log_every_steps (20) steps
GONE_S = 40.0  # the grace period (25 s) and the close after it
# A request must reach the ranks inside the epoch, before its one control step (step 20 of
# about 27; 0.6 s after the epoch's start on a 2-core machine at 2026-12-07's speed): one
# that arrives before the previous epoch's end is taken there, with no step checkpoint, and
# rank 0 writes the epoch's checkpoint (which the wait sees) just before that check. 0.5 s
# left CI 0.1 s for the request's way to the ranks, and it missed the step once.
INTO_EPOCH_S = 0.2


@pytest.fixture(scope="module")
def scheduler(prefect_api_url, tmp_path_factory) -> Iterator[dict]:
    """The module's Prefect API (this process's) and a Dask scheduler without workers: each
    test starts its own `dask worker` processes (`workers`)."""
    logs = tmp_path_factory.mktemp("worker-logs")
    url = prefect_api_url
    # tls=False: a tcp:// scheduler that `dask worker` processes and flows reach by address.
    with local_cluster(0, tls=False) as lc, distributed.Client(lc) as client:
        yield {
            "client": client,
            "address": lc.scheduler_address,
            "worker_env": {"PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
            "prefect_url": url,
            "logs": logs,
        }


def start_flow(project: Path, cluster: dict, monkeypatch) -> concurrent.futures.Future:
    """The tiny training in a thread of this process, on the scheduler."""
    training = CharLMParams(**TINY_PARAMS)
    return start_in_process(
        train_charlm, project, cluster["address"], monkeypatch, training=training
    )


class Workers:
    """`dask worker` processes of one test; all are stopped at its end."""

    def __init__(self, scheduler: dict):
        self.scheduler, self.started = scheduler, []

    def start(self) -> Service:
        env = base_env({**self.scheduler["worker_env"], **WORKER_ENV, "PYTHONPATH": str(CHECKOUT)})
        argv = [
            str(BIN / "dask"), "worker", self.scheduler["address"], "--nthreads", "1",
            "--host", "127.0.0.1", *LOOPBACK_HTTP, *WORKER_CLI_ARGS,
        ]  # fmt: skip
        service = spawn(f"dask-worker-{len(self.started)}", argv, env, self.scheduler["logs"])
        self.started.append(service)
        return service

    def of_rank(self, rank: int) -> tuple[str, Service]:
        """The worker address of `rank` (ranks are planned in address order) and the
        `dask worker` process, its nanny's, that runs it."""
        client = self.scheduler["client"]
        pids = client.run(os.getpid)
        address = sorted(pids)[rank]
        # A worker process descends from its `dask worker` process, through the forkserver
        # its nanny forks it from (ddpflow.cluster.forkserver).
        ancestors = {parent.pid for parent in psutil.Process(pids[address]).parents()}
        (service,) = [s for s in self.started if s.pid in ancestors]
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


def step_checkpoint_after(project: Path, epoch: int, since: float) -> Path:
    """The first checkpoint inside the epoch after `epoch` (epoch-000E.step-*.pt)."""
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        found = sorted(project.glob(f"artifacts/runs/*/checkpoints/epoch-{epoch:04d}.step-*.pt"))
        if found:
            print(f"{found[0].name} appeared {time.monotonic() - since:.1f} s after the request")
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint inside epoch {epoch + 1} after the request to leave")


def resumes(output: str) -> list[tuple[int, int]]:
    """(epoch, step) of each resume inside an epoch, from the flow's log."""
    found = re.findall(r"resuming at epoch (\d+)/\d+, step (\d+)/\d+", output)
    return [(int(epoch), int(step)) for epoch, step in found]


def assert_completed_with_two_stops(project: Path, output: str) -> list[str]:
    """Two restarts on the run, each epoch's metric once; returns the two causes."""
    client, run = the_run(project)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["ddpflow.restarts"] == "2", output[-3000:]
    assert metric_points(project, "restarts") == [(1, 1.0), (2, 2.0)]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert sorted(steps) == list(range(1, EPOCHS + 1)), "each epoch's metric exactly once"
    return [tags["ddpflow.restart.1.cause"], tags["ddpflow.restart.2.cause"]]


def leave_and_replace(workers: Workers, project: Path, epoch: int, leave: str) -> tuple[str, int]:
    """During the epoch after `epoch`, ask one rank's worker to leave (`retire`: rank 1's
    worker through retire_workers; `sigterm`: SIGTERM to rank 0's `dask worker`); wait for
    the checkpoint and for the `dask worker` to exit, then start a replacement. Returns the
    worker's address and the checkpoint's step."""
    client = workers.scheduler["client"]
    address, service = workers.of_rank(1 if leave == "retire" else 0)
    asked = time.monotonic()
    if leave == "retire":
        assert address in client.retire_workers([address])
    else:
        os.kill(service.pid, signal.SIGTERM)
    checkpoint = step_checkpoint_after(project, epoch, asked)
    assert process_gone(service.pid, GONE_S), f"`dask worker` did not exit after {leave}"
    print(f"its `dask worker` exited {time.monotonic() - asked:.1f} s after {leave}")
    workers.start()  # a replacement, as an autoscaler, a job queue or Kubernetes would start
    return address, int(checkpoint.name.rsplit("step-", 1)[1].split(".")[0])


# docs/fault-tolerance.md: `retire_workers` (epoch 2) and SIGTERM to a `dask worker`, its
# nanny (epoch 3), each make the group checkpoint at its next control step; the run resumes
# at each of those steps and ends with the uninterrupted run's weights and metrics. In the
# second, rank 0 runs on the leaving worker: the process that is leaving writes the checkpoint.
def test_retire_workers_and_sigterm_to_a_nanny_checkpoint_at_the_next_step_and_resume_there(
    scheduler, workers, charlm_reference, charlm_reference_project, tmp_path, monkeypatch
):
    cluster = scheduler
    flow_run = start_flow(tmp_path, cluster, monkeypatch)  # no step checkpoint before the stops
    wait_for_checkpoint(tmp_path, 1, flow_run)
    time.sleep(INTO_EPOCH_S)  # into epoch 2
    retired, first = leave_and_replace(workers, tmp_path, 1, "retire")
    wait_for_checkpoint(tmp_path, 2, flow_run)
    time.sleep(INTO_EPOCH_S)  # into epoch 3
    stopped, second = leave_and_replace(workers, tmp_path, 2, "sigterm")
    state, output = finish_in_process(flow_run, "resuming at epoch 3/", timeout_s=300)
    assert state.is_completed(), f"{state}\n{output[-4000:]}"
    print(f"resumed at {resumes(output)} (epoch, step)")
    # fit() reads a stop request every log_every_steps (20) steps; each resume starts at the
    # step its stop checkpointed, so no step is redone.
    assert resumes(output) == [(2, first), (3, second)], output[-3000:]
    assert first % CONTROL_EVERY == 0 and second % CONTROL_EVERY == 0, (first, second)
    causes = assert_completed_with_two_stops(tmp_path, output)
    assert f"worker {retired} asked to stop (its worker is closing" in causes[0], causes
    assert f"worker {stopped} asked to stop (its nanny is closing" in causes[1], causes
    assert len(restart_rows(cluster["prefect_url"], the_run(tmp_path)[1].info.run_id)) == 2
    assert_same_weights(final_weights(tmp_path), charlm_reference)
    assert_same_metrics(tmp_path, charlm_reference_project)
