"""Fault tolerance for real: worker processes of a 2-worker LocalCluster are SIGKILLed or
SIGSTOPped while the flow trains on them (the flow connects via DDPFLOW_DASK_ADDRESS), and the
run must finish with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import distributed
import pytest
from mlflow.tracking import MlflowClient

from ddpflow.cluster import local_cluster
from infra.services import free_port, start_prefect_server, stop
from tests.integration.charlm_runs import (
    EPOCHS,
    TINY,
    assert_same_weights,
    final_weights,
    finish,
    wait_for_checkpoint,
)
from tests.integration.conftest import REPO, project_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    """A Prefect server and a LocalCluster whose workers report to it."""
    home = tmp_path_factory.mktemp("prefect")
    server = start_prefect_server(free_port(), home, home)
    try:
        env = {"PREFECT_API_URL": server.url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        with local_cluster(2, env=env) as lc, distributed.Client(lc) as client:
            client.wait_for_workers(2, timeout=60)
            yield {"client": client, "env": {**env, "DDPFLOW_DASK_ADDRESS": lc.scheduler_address}}
    finally:
        stop(server)


def start_flow(project: Path, cluster: dict, *args: str) -> subprocess.Popen[str]:
    return start_module(project, cluster, "flows.train_charlm", *TINY, *args)


def start_module(project: Path, cluster: dict, module: str, *args: str) -> subprocess.Popen[str]:
    """`python -m module args` in `project`, on the cluster, once both workers are up."""
    project.mkdir(parents=True, exist_ok=True)
    cluster["client"].wait_for_workers(2, timeout=60)
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=project,
        env={**project_env(project), **cluster["env"], "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def a_worker_pid(client: distributed.Client) -> int:
    pids = client.run(os.getpid)
    return pids[sorted(pids)[-1]]


def the_run(project: Path):
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("ddpflow-charlm").experiment_id])
    assert len(runs) == 1, "one training, one MLflow run"
    return client, runs[0]


def assert_completed_once_with_one_restart(project: Path, output: str) -> None:
    client, run = the_run(project)
    assert run.info.status == "FINISHED"
    assert run.data.tags["ddpflow.restarts"] == "1", output[-3000:]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert sorted(steps) == list(range(1, EPOCHS + 1)), "each epoch's metric exactly once"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps and len(steps) == len(set(steps)), "the re-run steps are not logged twice"


def test_sigkill_of_a_worker_costs_one_restart_and_resumes_exactly(
    cluster, charlm_reference, tmp_path
):
    proc = start_flow(tmp_path, cluster)
    wait_for_checkpoint(tmp_path, 1, proc)
    os.kill(a_worker_pid(cluster["client"]), signal.SIGKILL)
    code, output = finish(proc)
    assert code == 0, output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    assert "resuming after epoch " in output, "the relaunched rank 0 says where it resumes"
    assert_same_weights(final_weights(tmp_path), charlm_reference)
    artifact = subprocess.run(
        [sys.executable, "-m", "prefect", "artifact", "inspect", "charlm-restarts"],
        env={**project_env(tmp_path), **cluster["env"]},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "DDP restarts" in artifact.stdout, artifact.stdout[-2000:] + artifact.stderr[-2000:]


def test_a_hung_worker_is_detected_by_timeout_and_restarted(cluster, charlm_reference, tmp_path):
    proc = start_flow(tmp_path, cluster, "--rank-timeout-s", "10")
    wait_for_checkpoint(tmp_path, 1, proc)
    pid = a_worker_pid(cluster["client"])
    os.kill(pid, signal.SIGSTOP)
    try:
        code, output = finish(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # in case the nanny did not kill it
    assert code == 0, output[-4000:]
    assert_completed_once_with_one_restart(tmp_path, output)
    _, run = the_run(tmp_path)
    assert "timed out" in run.data.tags["ddpflow.restart.1.cause"].lower() or "timeout" in (
        run.data.tags["ddpflow.restart.1.cause"].lower()
    )
    assert_same_weights(final_weights(tmp_path), charlm_reference)


def test_no_restart_left_fails_fast_naming_rank_worker_and_cause(cluster, tmp_path):
    proc = start_flow(tmp_path, cluster, "--max-restarts", "0")
    wait_for_checkpoint(tmp_path, 1, proc)
    killed_at = time.monotonic()
    os.kill(a_worker_pid(cluster["client"]), signal.SIGKILL)
    code, output = finish(proc)
    assert code == 1
    assert time.monotonic() - killed_at < 60
    message = output.rsplit("train-charlm failed:", 1)[-1]
    assert "max_restarts=0" in message and "rank" in message and "worker tcp://" in message
    _, run = the_run(tmp_path)
    assert run.info.status == "FAILED"


def test_a_killed_worker_costs_a_one_rank_run_one_restart(cluster, tmp_path):
    """A group of one has no peer whose collective fails: the launcher notices that the
    rank's worker left the cluster, and the run resumes on the restarted worker."""
    proc = start_flow(tmp_path, cluster, "--world-size", "1")
    wait_for_checkpoint(tmp_path, 1, proc)
    pids = cluster["client"].run(os.getpid)
    # The rank runs on one of the two workers; kill that one.
    busy = [a for a, n in cluster["client"].processing().items() if n]
    os.kill(pids[busy[0]] if busy else a_worker_pid(cluster["client"]), signal.SIGKILL)
    code, output = finish(proc)
    assert code == 0, output[-4000:]
    _, run = the_run(tmp_path)
    assert run.data.tags["ddpflow.restarts"] == "1", output[-3000:]
    assert "left the cluster" in run.data.tags["ddpflow.restart.1.cause"]


SWEEP_TRIALS = [{"epochs": 6}, {"epochs": 6, "lr": 0.02}, {"epochs": 1}]


def test_a_killed_worker_costs_a_sweep_only_the_trial_on_it(cluster, tmp_path):
    """Three one-rank trials on two workers. The worker under a running trial is killed:
    that trial fails promptly, and the queued trial runs on the worker's restarted process
    (its new address), not on the dead address, as does everything after it."""
    tiny = ["--hidden-size", "32", "--num-layers", "1", "--batch-size", "1024"]
    trials = json.dumps(SWEEP_TRIALS)
    proc = start_module(tmp_path, cluster, "flows.sweep_charlm", "--trials", trials, *tiny)
    wait_for_checkpoint(tmp_path, 1, proc)
    killed = sorted(cluster["client"].run(os.getpid))[-1]
    os.kill(cluster["client"].run(os.getpid)[killed], signal.SIGKILL)
    code, output = finish(proc)
    assert code == 0, output[-4000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ddpflow-charlm-sweep")
    children = [
        r for r in client.search_runs([experiment.experiment_id]) if "ddpflow.trial" in r.data.tags
    ]
    by_trial = {int(r.data.tags["ddpflow.trial"]): r for r in children}
    assert sorted(by_trial) == [0, 1, 2]
    failed = [i for i, r in by_trial.items() if r.info.status == "FAILED"]
    assert len(failed) == 1 and failed[0] in (0, 1), output[-3000:]
    assert by_trial[failed[0]].data.tags["ddpflow.workers"] == killed
    assert "left the cluster" in by_trial[failed[0]].data.tags["ddpflow.error"]
    assert by_trial[2].info.status == "FINISHED", by_trial[2].data.tags.get("ddpflow.error")
    assert by_trial[2].data.tags["ddpflow.workers"] != killed
