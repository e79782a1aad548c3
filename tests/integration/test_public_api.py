"""The public API for real: ddpflow.run() on a LocalCluster of two worker processes, the
user's training function being examples/digits.py's, tracked in a real MLflow SQLite store.
A worker is SIGKILLed mid-run by a real signal; nothing is mocked. Bad input must fail in
the caller's process before any rank runs."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

import ddpflow
from ddpflow.checkpoint.store import CheckpointStore, saved_names
from ddpflow.tracking.run import TRACKING_INCOMPLETE_TAG
from examples import digits, digits_fit, regression_mlp
from tests.helpers import api_train_functions as functions

pytestmark = pytest.mark.integration
EPOCHS = 6  # the fewest that reach 0.9 held-out accuracy with margin (0.937 measured)


def tracking(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def final_state(checkpoint_dir: Path) -> dict:
    state = CheckpointStore(str(checkpoint_dir)).load()
    assert state["epoch"] == EPOCHS
    return {name: state[f"{name}_state"] for name in saved_names(state)}


@pytest.fixture(scope="module")
def reference(dask_client, tmp_path_factory) -> dict:
    """An uninterrupted, tracked run of the example: what the other tests compare with."""
    folder = tmp_path_factory.mktemp("digits-reference")
    lines: list[str] = []
    events: list[ddpflow.Progress] = []
    accuracy = digits.run_digits(
        dask_client,
        str(folder / "checkpoints"),
        epochs=EPOCHS,
        tracking_uri=tracking(folder),
        experiment="digits",
        on_progress=lines.append,
        on_event=events.append,
    )
    return {"accuracy": accuracy, "folder": folder, "lines": lines, "events": events}


def the_run(folder: Path, experiment: str):
    client = MlflowClient(tracking(folder))
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def metric_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


# docs/api.md "A first training": the digits example reaches 0.9 held-out accuracy on two
# ranks; its MLflow run ends FINISHED with each epoch's train_loss once and test_accuracy.
def test_the_digits_example_trains_and_is_tracked(reference):
    assert reference["accuracy"] >= 0.9
    client, run = the_run(reference["folder"], "digits")
    assert run.info.status == "FINISHED"
    assert metric_steps(client, run.info.run_id, "train_loss") == list(range(1, EPOCHS + 1))
    assert run.data.metrics["test_accuracy"] == pytest.approx(reference["accuracy"])
    # MLflow's copies of the checkpoints sit beside the SQLite store, not in the cwd's mlruns.
    assert run.info.artifact_uri.startswith((reference["folder"] / "mlartifacts").as_uri())
    copies = Path(run.info.artifact_uri.removeprefix("file://")) / "checkpoints"
    assert (copies / f"epoch-{EPOCHS:04d}.pt").is_file()
    # ctx.report() lines reach on_progress, one per epoch from rank 0, in order.
    found = map(re.compile(r"epoch (\d+)/").match, reference["lines"])
    epochs = [int(m.group(1)) for m in found if m]
    assert epochs == list(range(1, EPOCHS + 1)), reference["lines"]
    # on_event gets the same stream, lines included: one channel feeds both.
    events = reference["events"]
    assert reference["lines"] == [e.line for e in events if e.line is not None]


# docs/api.md "TrainContext": each rank knows the Dask worker it runs in and its process id.
def test_each_rank_knows_its_worker_and_process(dask_client):
    dask_client.wait_for_workers(2, timeout=120)
    pids = dask_client.run(os.getpid)  # worker address -> pid of its process
    ranks = ddpflow.run(dask_client, functions.where_each_rank_runs, world_size=2)
    assert sorted(rank for rank, _, _ in ranks) == [0, 1]
    assert {address: pid for _, address, pid in ranks} == pids


# docs/api.md "Restarts and exact resume": a worker killed mid-run costs one restart, the
# training resumes from its latest checkpoint, and the final weights are bitwise those of
# the uninterrupted run; the metrics of re-run epochs are not logged twice.
def test_a_killed_worker_costs_one_restart_and_the_resume_is_exact(
    dask_client, reference, tmp_path
):
    dask_client.wait_for_workers(2, timeout=120)
    addresses = {pid: address for address, pid in dask_client.run(os.getpid).items()}
    kill_reported_pid = functions.KillReportedPid()
    restarts: list[ddpflow.Restart] = []

    accuracy = ddpflow.run(
        dask_client,
        functions.digits_killed_after_checkpoint,
        EPOCHS,
        world_size=2,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        tracking_uri=tracking(tmp_path),
        experiment="digits-killed",
        on_progress=kill_reported_pid,
        on_restart=restarts.append,
    )
    killed = kill_reported_pid.killed
    assert len(killed) == 1, "rank 1 reported its pid once"
    assert len(restarts) == 1, restarts
    assert addresses[killed[0]] in restarts[0].cause, "the cause names the lost worker"
    assert restarts[0].world_size == 2 and restarts[0].restarted_workers == []
    # The killed worker is named lost, and its nanny's replacement (a new address) new.
    assert restarts[0].lost_workers == [addresses[killed[0]]], restarts[0]
    (replacement,) = restarts[0].new_workers
    assert replacement not in addresses.values()
    reference_state = final_state(reference["folder"] / "checkpoints")
    state = final_state(tmp_path / "checkpoints")
    assert state["model"].keys() == reference_state["model"].keys()
    for name, tensor in reference_state["model"].items():
        assert torch.equal(state["model"][name], tensor), f"{name} differs after the resume"
    assert accuracy == reference["accuracy"]
    client, run = the_run(tmp_path, "digits-killed")
    assert run.info.status == "FINISHED"
    assert run.data.tags["ddpflow.restarts"] == "1"
    assert metric_steps(client, run.info.run_id, "train_loss") == list(range(1, EPOCHS + 1))
    dask_client.wait_for_workers(2, timeout=120)  # the nanny's new worker, for later tests


# docs/api.md "ddpflow.fit": the same digits trained by fit() on two ranks reach 0.9 held-out
# accuracy; a worker killed inside an epoch costs one restart, the training resumes from the
# checkpoint inside that epoch (not the epoch's start), the final weights are bitwise the
# uninterrupted run's, and every step's train_loss is logged exactly once.
def test_fit_resumes_inside_the_epoch_after_a_killed_worker_exactly(dask_client, tmp_path):
    dask_client.wait_for_workers(2, timeout=120)
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference_accuracy = ddpflow.run(
        dask_client,
        digits_fit.train,
        EPOCHS,
        world_size=2,
        checkpoint_dir=str(reference_dir / "checkpoints"),
        tracking_uri=tracking(reference_dir),
        experiment="digits-fit",
    )
    assert reference_accuracy >= 0.9
    kill_reported_pid = functions.KillReportedPid()
    restarts: list[ddpflow.Restart] = []
    lines: list[str] = []

    def progress(line: str) -> None:
        lines.append(line)
        kill_reported_pid(line)

    accuracy = ddpflow.run(
        dask_client,
        functions.digits_fit_killed_mid_epoch,
        EPOCHS,
        world_size=2,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        tracking_uri=tracking(tmp_path),
        experiment="digits-fit-killed",
        on_progress=progress,
        on_restart=restarts.append,
    )
    assert len(kill_reported_pid.killed) == 1 and len(restarts) == 1, (restarts, lines)
    assert any(line.startswith("resuming at epoch 2/6, step 10/") for line in lines), (
        "the relaunch resumes inside epoch 2, from its step-10 checkpoint"
    )
    reference_state = final_state(reference_dir / "checkpoints")
    state = final_state(tmp_path / "checkpoints")
    assert sorted(state) == ["model", "optimizer", "scheduler"]
    for name, tensor in reference_state["model"].items():
        assert torch.equal(state["model"][name], tensor), f"{name} differs after the resume"
    assert state["scheduler"] == reference_state["scheduler"]
    assert accuracy == reference_accuracy
    reference_client, reference_run = the_run(reference_dir, "digits-fit")
    client, run = the_run(tmp_path, "digits-fit-killed")
    assert run.info.status == "FINISHED" and run.data.tags["ddpflow.restarts"] == "1"
    steps = metric_steps(client, run.info.run_id, "train_loss")
    assert steps == metric_steps(reference_client, reference_run.info.run_id, "train_loss")
    assert len(steps) == len(set(steps)), "no step logged twice"
    dask_client.wait_for_workers(2, timeout=120)  # the nanny's new worker, for later tests


# docs/api.md "Reading a checkpoint" and "ddpflow.fit": a user's own model (examples/
# regression_mlp.py, an MLP with dropout, written only against the documented API) loses a
# worker inside epoch 2 and resumes exactly: fit's history covers every epoch, and the final
# checkpoint read back with ddpflow.load_checkpoint holds the uninterrupted run's weights.
def test_a_users_own_model_resumes_exactly_and_its_checkpoint_loads(dask_client, tmp_path):
    dask_client.wait_for_workers(2, timeout=120)
    reference = ddpflow.run(
        dask_client,
        regression_mlp.train,
        4,
        world_size=2,
        checkpoint_dir=str(tmp_path / "reference"),
    )
    assert len(reference) == 4 and reference[-1] < reference[0], reference
    kill_reported_pid = functions.KillReportedPid()
    restarts: list[ddpflow.Restart] = []
    val_losses = ddpflow.run(
        dask_client,
        functions.regression_killed_mid_epoch,
        4,
        world_size=2,
        checkpoint_dir=str(tmp_path / "killed"),
        on_progress=kill_reported_pid,
        on_restart=restarts.append,
    )
    assert len(kill_reported_pid.killed) == 1 and len(restarts) == 1, restarts
    assert val_losses == reference, "every epoch, those before the restart too, bitwise"
    uninterrupted, resumed = regression_mlp.build_model(), regression_mlp.build_model()
    first = ddpflow.load_checkpoint(str(tmp_path / "reference"), model=uninterrupted)
    second = ddpflow.load_checkpoint(str(tmp_path / "killed"), model=resumed)
    assert first.step == second.step == 4 and second.names == ["model", "optimizer"]
    for name, tensor in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), f"{name} differs after the resume"
    dask_client.wait_for_workers(2, timeout=120)  # the nanny's new worker, for later tests


# docs/api.md "Errors": asking for more ranks than workers fails before any rank runs,
# naming world_size and the worker count.
def test_world_size_larger_than_the_cluster_fails_before_any_work(dask_client, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match=r"world_size=3 .*\(2 workers\).*world_size=2 or less"):
        ddpflow.run(dask_client, functions.touches_marker, str(marker), world_size=3)
    assert list(tmp_path.iterdir()) == []


# docs/api.md "Errors": a training function that cannot travel to the workers fails before
# any work, naming the fix.
def test_an_unpicklable_function_fails_before_any_work_naming_the_fix(dask_client):
    with pytest.raises(TypeError, match=r"cannot be sent to the Dask workers.*module level"):
        ddpflow.run(dask_client, functions.holds_a_lock())


# docs/api.md "Checkpoints and resume": resume() with other names than the checkpoint holds
# fails naming both sets.
def test_resume_with_other_names_than_saved_names_the_mismatch(dask_client, reference, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(reference["folder"] / "checkpoints", checkpoints)
    dask_client.wait_for_workers(2, timeout=120)
    started = time.monotonic()
    with pytest.raises(ddpflow.LaunchError) as raised:
        ddpflow.run(dask_client, functions.resumes_model_only, checkpoint_dir=str(checkpoints))
    message = str(raised.value)
    assert "resume() got ['model'] but the checkpoint holds" in message, message
    assert "['model', 'optimizer', 'scheduler']" in message, message
    assert isinstance(raised.value, ddpflow.RepeatedFailure), "not restarted twice in vain"
    assert time.monotonic() - started < 60


# docs/api.md "Tracking": what MLflow never got is said on the run. A spool of 10 bytes on
# the workers refuses all three logging calls; ddpflow.run still returns, and the run ends
# FINISHED with the tag that counts what it lacks.
def test_a_run_that_lacks_logging_calls_is_tagged_incomplete(dask_client, tmp_path):
    def set_spool_bound(value: str | None) -> None:
        if value is None:
            os.environ.pop("DDPFLOW_TRACKING_SPOOL_MB", None)
        else:
            os.environ["DDPFLOW_TRACKING_SPOOL_MB"] = value

    dask_client.run(set_spool_bound, "0.00001")
    try:
        result = ddpflow.run(
            dask_client,
            functions.logs_three_points,
            tracking_uri=tracking(tmp_path),
            experiment="incomplete",
        )
    finally:
        dask_client.run(set_spool_bound, None)
    assert result == "trained"
    client, run = the_run(tmp_path, "incomplete")
    assert run.info.status == "FINISHED"
    assert client.get_metric_history(run.info.run_id, "x") == []
    assert run.data.tags[TRACKING_INCOMPLETE_TAG].startswith(
        "3 logging calls are not in this run (3 not kept: the spool was full)"
    )
