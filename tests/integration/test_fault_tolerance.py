"""Fault tolerance for real: worker processes of a 2-worker LocalCluster are SIGKILLed,
SIGSTOPped or sent SIGTERM while a flow trains on them (connected by DDPFLOW_DASK_ADDRESS),
and the run must finish with exactly the weights of an uninterrupted run. The trainings use
two LSTM layers with dropout (charlm_runs.TINY_PARAMS), so the exact resume depends on the
per-step reseed.

The flows run in a thread of the test's process on the module's Prefect API and cluster
(flow_services), while the test's own thread stops the workers; what the flow logs, the test
reads back from the API. The uninterrupted reference is a `python -m` run of its own
(charlm_reference_project), so each resume is compared with what a user's command gives."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
import httpx
import pytest
from distributed.core import Status
from distributed.deploy.spec import SpecCluster
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from ddpflow.cluster.build import local_cluster
from ddpflow.distributed.supervisor import heartbeats
from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION
from ddpflow.tracking.run import FINAL_WORLD_SIZE_TAG, WORLD_SIZES_TAG
from flows.params import CharLMParams, SweepParams
from flows.sweep_charlm import sweep_charlm
from flows.train_charlm import train_charlm
from tests.helpers.charlm_runs import (
    EPOCHS,
    SMALL_SOURCE,
    TINY_PARAMS,
    assert_completed_once_with_one_restart,
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

pytestmark = pytest.mark.integration
TRAINED = "ddpflow: pet-name model trained"  # the flow's summary, its last log line


@pytest.fixture(scope="module")
def cluster(flow_services) -> Iterator[distributed.Client]:
    """The test's client of the module's cluster: it finds and stops the workers."""
    with distributed.Client(flow_services, set_as_default=False) as client:
        client.wait_for_workers(2, timeout=120)
        yield client


def wait_for_both_workers(client: distributed.Client, timeout_s: float = 120) -> None:
    """Until each of the 2 nannies of the client's cluster (a LocalCluster in this process)
    has a worker process it saw start, and the scheduler has both. The scheduler lists a
    restarted worker before its nanny is done starting it, and the tests follow each other
    within seconds here, so each test stops only workers whose start is complete. (A worker
    whose restart took longer than Dask's lost-worker timeout used to lose its nanny for
    good, 1 of 2 workers for the rest of the module: ddpflow/cluster/kept_nannies.py.)"""
    address = client.scheduler.address
    (local,) = [c for c in list(SpecCluster._instances) if c.scheduler_address == address]
    deadline = time.monotonic() + timeout_s
    while True:
        nannies = list(local.workers.values())
        processes = [n.process for n in nannies if n.process is not None]
        started = [p for p in processes if p.status == Status.running and p.process.is_alive()]
        if len(nannies) == len(started) == 2:
            return
        assert time.monotonic() < deadline, f"workers not back: {[n.status for n in nannies]}"
        time.sleep(0.2)
    client.wait_for_workers(2, timeout=timeout_s)


@pytest.fixture
def start(flow_services, cluster, monkeypatch):
    """Start the tiny training (TINY_PARAMS with `overrides`) in a thread, once both workers
    are up; `address` and `env` as run_in_process takes them."""

    def start(
        project: Path, address: str | None = flow_services, env: dict[str, str] | None = None,
        **overrides: Any,
    ) -> concurrent.futures.Future:  # fmt: skip
        wait_for_both_workers(cluster)
        training = CharLMParams(**{**TINY_PARAMS, **overrides})
        return start_in_process(train_charlm, project, address, monkeypatch, env, training=training)

    return start


def prefect_url() -> str:
    return PREFECT_API_URL.value()


def worker(client: distributed.Client, rank: int) -> tuple[str, int]:
    """(address, pid) of the worker that runs `rank` of a 2-rank group: ranks are planned
    in address order."""
    pids = client.run(os.getpid)
    address = sorted(pids)[rank]
    return address, pids[address]


def a_worker_pid(client: distributed.Client) -> int:
    return worker(client, 1)[1]


def resumed_after_epoch(output: str) -> int:
    """The epoch the relaunched rank 0 resumed after (it says so in the flow's log)."""
    found = re.findall(r"resuming after epoch (\d+)/", output)
    assert len(found) == 1, f"one resume expected, the log says {found}: {output[-3000:]}"
    return int(found[0])


def assert_restart_recorded(project: Path) -> tuple[str, list[str]]:
    """One restart, on the MLflow run (tags and `restarts` metric) and in the Prefect
    artifact, which agree on its cause. Returns the cause and the artifact's row."""
    _, run = the_run(project)
    tags = run.data.tags
    assert tags["ddpflow.restarts"] == "1"
    assert metric_points(project, "restarts") == [(1, 1.0)], "the restarts metric counts it"
    cause = tags["ddpflow.restart.1.cause"]
    # The cause names the failed rank, its worker and what happened to it.
    assert re.match(r"DDP group \w+: rank [01] on worker tcp://127\.0\.0\.1:\d+: \S", cause), cause
    (row,) = restart_rows(prefect_url(), run.info.run_id)
    attempt, _, _lost, _new, _hung, heal_time, artifact_cause = row
    assert attempt == "1"
    assert re.fullmatch(r"\d+\.\d s", heal_time), heal_time
    assert artifact_cause.startswith(cause.replace("|", "/")[:200]), (artifact_cause, cause)
    return cause, row


# docs/fault-tolerance.md: a killed worker costs one restart, and the resume is exact (weights
# and every metric step as in an uninterrupted run, dropout on); restarts are on the run and
# in the `charlm-restarts` artifact.
def test_sigkill_of_a_worker_costs_one_restart_and_resumes_exactly(
    start, cluster, charlm_reference, charlm_reference_project, tmp_path
):
    flow_run = start(tmp_path)
    wait_for_checkpoint(tmp_path, 1, flow_run)
    os.kill(a_worker_pid(cluster), signal.SIGKILL)
    state, output = finish_in_process(flow_run, "resuming", TRAINED)
    assert state.is_completed(), output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    assert 1 <= resumed_after_epoch(output) < EPOCHS, "the kill came mid-run"
    assert_same_weights(final_weights(tmp_path), charlm_reference)
    assert_same_metrics(tmp_path, charlm_reference_project)
    _, row = assert_restart_recorded(tmp_path)
    assert row[1] == "2", "the relaunch took both workers again"
    # Columns: restart, world size, lost workers, new workers, restarted (hung) workers, ...
    assert row[4] == "-", "no worker hung: the nanny replaced the dead one by itself"


STEP_EVERY = 5  # --checkpoint-every-steps of the mid-epoch kill


def resumed_inside_epoch(output: str) -> tuple[int, int, int]:
    """(epoch, step, steps per epoch) the relaunched rank 0 resumed at, from the flow's log."""
    found = re.findall(r"resuming at epoch (\d+)/\d+, step (\d+)/(\d+)", output)
    assert len(found) == 1, f"one resume inside an epoch expected, found {found}: {output[-3000:]}"
    epoch, step, steps = (int(n) for n in found[0])
    return epoch, step, steps


def steps_redone(client: distributed.Client) -> int:
    """Global steps the killed attempt had done past the step the relaunch started from, as
    the ranks noted them on the surviving worker (heartbeats.rank_steps, oldest first): its
    last two records are the killed attempt's (from step 1) and the relaunch's. The
    restarted worker is a new process with the relaunch's record only."""
    answers = client.run(heartbeats.rank_steps)
    survivors = [
        (killed, resumed)
        for *_, killed, resumed in (r for r in answers.values() if len(r) >= 2)
        if killed[0] != resumed[0] and killed[2] == 1 and resumed[2] > 1
    ]
    assert len(survivors) == 1, answers
    ((killed, resumed),) = survivors
    return killed[3] - (resumed[2] - 1)


# docs/fault-tolerance.md: with step checkpoints, a worker killed mid-epoch costs at most
# checkpoint_every_steps steps, and the resume is exact. Exactly that many when the kill lands
# after a rank noted the Nth step but before that step's checkpoint was written (the ranks
# gather their loss sums first): seen once in CI, 5 redone with N = 5. The reference run has no step
# checkpoints: the weights do not depend on where checkpoints fall (per-step reseed).
def test_a_kill_mid_epoch_resumes_from_the_last_step_checkpoint_exactly(
    start, cluster, charlm_reference, charlm_reference_project, tmp_path
):
    flow_run = start(tmp_path, checkpoint_every_steps=STEP_EVERY)
    wait_for_checkpoint(tmp_path, 1, flow_run, step=True)  # inside epoch 2
    time.sleep(0.15)  # a few steps (30-60 ms each here) past the checkpoint: redone
    os.kill(a_worker_pid(cluster), signal.SIGKILL)
    state, output = finish_in_process(flow_run, "resuming", TRAINED)
    assert state.is_completed(), output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    epoch, step, steps_per_epoch = resumed_inside_epoch(output)
    assert epoch == 2 and 0 < step < steps_per_epoch and step % STEP_EVERY == 0, (epoch, step)
    redone = steps_redone(cluster)
    print(f"resumed at epoch {epoch} step {step}/{steps_per_epoch}; {redone} steps redone")
    assert 0 <= redone <= STEP_EVERY, f"{redone} steps redone"
    client, run = the_run(tmp_path)
    copies = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    # Only epoch checkpoints are copied into MLflow, and only those the store still keeps
    # (its newest keep_last, step checkpoints counted): the last epoch's at least.
    assert copies and copies[-1] == f"checkpoints/epoch-{EPOCHS:04d}.pt", copies
    assert all(".step-" not in copy for copy in copies), copies
    assert_same_weights(final_weights(tmp_path), charlm_reference)
    assert_same_metrics(tmp_path, charlm_reference_project)


# docs/fault-tolerance.md: a worker sent SIGTERM makes its group checkpoint at the next control
# step, its process exits, and the run resumes from that step, not from the epoch's start.
def test_sigterm_to_a_worker_checkpoints_at_the_next_step_and_resumes_there(
    start, cluster, charlm_reference, charlm_reference_project, tmp_path
):
    flow_run = start(tmp_path)  # defaults: no step checkpoint before the stop
    wait_for_checkpoint(tmp_path, 1, flow_run)
    time.sleep(0.5)  # into epoch 2
    address, pid = worker(cluster, 1)
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert process_gone(pid, DEFAULT_SUPERVISION.grace_s + 5), "the worker did not exit"
    print(f"the worker exited {time.monotonic() - sent:.1f} s after SIGTERM")
    state, output = finish_in_process(flow_run, "resuming", TRAINED)
    assert state.is_completed(), output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    cause, _ = assert_restart_recorded(tmp_path)
    assert f"worker {address} asked to stop (SIGTERM)" in cause, cause
    epoch, step, steps_per_epoch = resumed_inside_epoch(output)
    print(f"resumed at epoch {epoch} step {step}/{steps_per_epoch}")
    # fit() reads the request at its control points: every log_every_steps (20) steps.
    assert epoch == 2 and step > 0 and step % 20 == 0, (epoch, step)
    assert steps_redone(cluster) == 0, "the group stopped at its checkpoint's step"
    assert_same_weights(final_weights(tmp_path), charlm_reference)
    assert_same_metrics(tmp_path, charlm_reference_project)


# docs/fault-tolerance.md: a hung worker is detected by the rank timeout, restarted, and the
# resume is exact. Rank 0's worker hangs: the one that logs to MLflow and writes checkpoints.
def test_a_hung_worker_is_detected_by_timeout_and_restarted(
    start, cluster, charlm_reference, charlm_reference_project, tmp_path
):
    # The timeout also bounds each rank's start and first step, and a relaunched worker
    # imports torch and MLflow first: 10 s was too short on a loaded 2-core machine.
    flow_run = start(tmp_path, rank_timeout_s=30)
    wait_for_checkpoint(tmp_path, 1, flow_run)
    address, pid = worker(cluster, 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        state, output = finish_in_process(flow_run, "resuming", TRAINED)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # in case the nanny did not kill it
    assert state.is_completed(), output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    assert 1 <= resumed_after_epoch(output) < EPOCHS, "the hang came mid-run"
    cause, row = assert_restart_recorded(tmp_path)
    assert "timed out" in cause.lower() or "timeout" in cause.lower(), cause
    assert row[4] == address, "the hung worker was restarted, and the artifact names it"
    assert_same_metrics(tmp_path, charlm_reference_project)
    assert_same_weights(final_weights(tmp_path), charlm_reference)


# docs/fault-tolerance.md: with no restart left the flow fails naming rank, worker and cause.
def test_no_restart_left_fails_fast_naming_rank_worker_and_cause(start, cluster, tmp_path):
    flow_run = start(tmp_path, max_restarts=0)
    wait_for_checkpoint(tmp_path, 1, flow_run)
    killed_at = time.monotonic()
    os.kill(a_worker_pid(cluster), signal.SIGKILL)
    state = flow_run.result(timeout=600)
    assert state.is_failed(), state
    assert time.monotonic() - killed_at < 60
    message = str(state.result(raise_on_failure=False))
    assert "max_restarts=0" in message and "rank" in message and "worker tcp://" in message
    _, run = the_run(tmp_path)
    assert run.info.status == "FAILED"


# docs/fault-tolerance.md: a rank without peers fails within a second when its worker dies.
def test_a_killed_worker_costs_a_one_rank_run_one_restart(start, cluster, tmp_path):
    """A group of one has no peer whose collective fails: the launcher notices that the
    rank's worker left the cluster, and the run resumes on the restarted worker."""
    flow_run = start(tmp_path, world_size=1)
    wait_for_checkpoint(tmp_path, 1, flow_run)
    pids = cluster.run(os.getpid)
    # The rank runs on one of the two workers; kill that one.
    busy = [a for a, n in cluster.processing().items() if n]
    os.kill(pids[busy[0]] if busy else a_worker_pid(cluster), signal.SIGKILL)
    state, output = finish_in_process(flow_run, TRAINED)
    assert state.is_completed(), output[-4000:]
    _, run = the_run(tmp_path)
    assert run.data.tags["ddpflow.restarts"] == "1", output[-3000:]
    assert "left the cluster" in run.data.tags["ddpflow.restart.1.cause"]


# The first two run side by side, long enough after their first checkpoint for the kill to
# find both still training; the third waits for a worker. On the small corpus: on the full
# one (the sweep's default) this test cost 43 CPU-seconds, most of it the trial not killed.
SWEEP_TRIALS = [{"epochs": 5}, {"epochs": 5, "lr": 0.02}, {"epochs": 1}]


# docs/sweeps.md: a worker that dies costs only the trial on it.
def test_a_killed_worker_costs_a_sweep_only_the_trial_on_it(
    flow_services, cluster, monkeypatch, tmp_path
):
    """Three one-rank trials on two workers. The worker under a running trial is killed:
    that trial fails promptly, and the queued trial runs on the worker's restarted process
    (its new address), not on the dead address, as does everything after it."""
    wait_for_both_workers(cluster)
    sweep = SweepParams(
        trials=SWEEP_TRIALS, source=SMALL_SOURCE, hidden_size=32, num_layers=1, batch_size=1024
    )
    flow_run = start_in_process(sweep_charlm, tmp_path, flow_services, monkeypatch, sweep=sweep)
    wait_for_checkpoint(tmp_path, 1, flow_run)
    killed = sorted(cluster.run(os.getpid))[-1]
    os.kill(cluster.run(os.getpid)[killed], signal.SIGKILL)
    state = flow_run.result(timeout=600)
    assert state.is_completed(), state
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ddpflow-charlm-sweep")
    children = [
        r for r in client.search_runs([experiment.experiment_id]) if "ddpflow.trial" in r.data.tags
    ]
    by_trial = {int(r.data.tags["ddpflow.trial"]): r for r in children}
    assert sorted(by_trial) == [0, 1, 2]
    failed = [i for i, r in by_trial.items() if r.info.status == "FAILED"]
    assert len(failed) == 1 and failed[0] in (0, 1), state
    assert by_trial[failed[0]].data.tags["ddpflow.workers"] == killed
    assert "left the cluster" in by_trial[failed[0]].data.tags["ddpflow.error"]
    assert by_trial[2].info.status == "FINISHED", by_trial[2].data.tags.get("ddpflow.error")
    assert by_trial[2].data.tags["ddpflow.workers"] != killed


# docs/fault-tolerance.md: with --min-workers, a run whose worker does not come back within
# DDPFLOW_HEAL_TIMEOUT_S goes on with the ranks it has.
def test_a_worker_that_does_not_come_back_leaves_the_run_to_the_others(start, tmp_path):
    """A cluster of its own: one of its workers dies with its nanny (a lost host), so
    nothing replaces it; after the heal timeout the run resumes on one rank."""
    with (
        local_cluster(2, tls=False) as lc,  # reached by address
        distributed.Client(lc, set_as_default=False) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        # Two epochs suffice: the second one runs on the rank that is left.
        flow_run = start(
            tmp_path, lc.scheduler_address, {"DDPFLOW_HEAL_TIMEOUT_S": "5"},
            epochs=2, world_size=2, min_workers=1,
        )  # fmt: skip
        wait_for_checkpoint(tmp_path, 1, flow_run)
        address, pid = worker(client, 1)
        (nanny,) = [n for n in lc.workers.values() if n.worker_address == address]
        nanny.close_gracefully()  # it will not start a new worker process
        os.kill(pid, signal.SIGKILL)
        state, output = finish_in_process(flow_run, "resuming", TRAINED)
    assert state.is_completed(), output[-4000:]
    assert resumed_after_epoch(output) == 1
    _, run = the_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert [p[0] for p in metric_points(tmp_path, "val_loss")] == [1, 2], "each epoch once"
    _, row = assert_restart_recorded(tmp_path)
    assert row[1] == "1", "the relaunch ran one rank"


def _prefect_post(url: str, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{url}{path}", json=body, timeout=30)
    response.raise_for_status()
    found = response.json()
    return found["events"] if isinstance(found, dict) else found


# docs/fault-tolerance.md "Growing": a flow with --max-workers asks the cluster it started for
# that many workers, and grows onto the one that joins: a log line, a Prefect event, a note
# on the progress artifact and the world_size metric say so.
def test_a_flow_with_max_workers_grows_onto_the_worker_its_cluster_adds(start, tmp_path):
    env = {
        "DDPFLOW_DASK_WORKERS": "2",  # the flow's own LocalCluster starts with 2
        "DDPFLOW_GROW_SETTLE_S": "2",
    }
    flow_run = start(tmp_path, None, env, epochs=6, world_size=2, max_workers=3)
    state, output = finish_in_process(flow_run, "world size 2 -> 3", TRAINED)
    assert state.is_completed(), output[-4000:]
    assert "max_workers=3: scaled the cluster to 3 workers" in output
    line = re.search(r"world size 2 -> 3 \(joined: (tcp|tls)://127\.0\.0\.1:\d+\)", output)
    assert line, output[-4000:]
    assert [value for _, value in metric_points(tmp_path, "world_size")] == [2.0, 3.0]
    # What trained, not what started: the summary, the run's tags and the artifact name the
    # size it ended at and the history; the param stays the size it was launched with.
    assert "  world size         3 ranks (2 → 3)" in output, output[-4000:]
    _, run = the_run(tmp_path)
    assert run.data.tags[FINAL_WORLD_SIZE_TAG] == "3"
    assert run.data.tags[WORLD_SIZES_TAG] == "2 → 3"
    assert run.data.params["world_size"] == "2"
    assert "ddpflow.restarts" not in run.data.tags, "a grow is not a restart"
    url = prefect_url()
    deadline = time.monotonic() + 60
    events: list[dict] = []
    while not events and time.monotonic() < deadline:  # the server persists events in batches
        wanted = {"event": {"name": ["ddpflow.training.resized"]}, "resource": {
            "id": [f"ddpflow.mlflow-run.{run.info.run_id}"]}}  # fmt: skip
        events = _prefect_post(url, "/events/filter", {"filter": wanted})
        time.sleep(1)
    assert [(e["payload"]["old_size"], e["payload"]["new_size"], e["payload"]["reason"])
            for e in events] == [(2, 3, "joined")]  # fmt: skip
    this_run = {"any_": [str(state.state_details.flow_run_id)]}
    progress = _prefect_post(
        url, "/artifacts/filter",
        {"artifacts": {"key": {"any_": ["charlm-progress"]}, "flow_run_id": this_run}},
    )  # fmt: skip
    assert any(line.group(0) in (a.get("description") or "") for a in progress), progress
    ended = "ended at world size 3 ranks (2 → 3)"
    assert any(ended in (a.get("description") or "") for a in progress), progress
