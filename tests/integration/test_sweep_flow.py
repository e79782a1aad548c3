"""The sweep flow end to end: tiny trials on a 2-worker LocalCluster, MLflow, Prefect.

Five trials: one that crashes mid-training first (fault injection), three that train and one
invalid (rejected before it starts). The bad two are reported; the other three still complete,
one of them on the worker the crash gave back. The flow runs in the test's process on the
module's flow_services, whose workers preload the fault injection (PRELOAD_ENV).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from flows.params import ParameterError, SweepParams
from flows.sweep_charlm import sweep_charlm
from tests.helpers.charlm_runs import STEPPED_SOURCE
from tests.helpers.in_process import run_in_process
from tests.helpers.prefect_reads import flow_run_logs, flow_run_records
from tests.helpers.trial_faults import FAULTY_LR, PRELOAD_ENV

pytestmark = pytest.mark.integration

EXPERIMENT = "sweep-test"
MODEL = "sweep-test-model"
TRIALS = [
    {"lr": FAULTY_LR},  # crashes after its first epoch (trial_faults), while trial 1 trains
    {"lr": 0.01, "hidden_size": 32},
    {"lr": 0.002},
    {"lr": 0.005, "batch_size": 4096},
    {"lr": -1},  # invalid: never launched
]
CRASHED, COMPLETED, INVALID = 0, (1, 2, 3), 4
# Every trial's defaults: tiny, on a third of the shipped corpus (shorter epochs, the same
# code path).
DEFAULTS = {
    "epochs": 2,
    "hidden_size": 16,
    "num_layers": 1,
    "batch_size": 2048,
    "experiment": EXPERIMENT,
    "model_name": MODEL,
    "promote": True,
    "source": STEPPED_SOURCE,
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def flow_services_env() -> dict[str, str]:
    return PRELOAD_ENV


def sweep(project: Path, flow_services: str, monkeypatch: Any, **params: Any) -> Any:
    """One sweep-charlm run in this process: its final state."""
    settings = SweepParams(**{**DEFAULTS, **params})
    return run_in_process(
        sweep_charlm, project, flow_services, monkeypatch, sweep=settings, return_state=True
    )


@pytest.fixture(scope="module")
def swept(flow_services, tmp_path_factory) -> dict:
    project = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as patch:
        state = sweep(project, flow_services, patch, trials=TRIALS)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {
        int(r.data.tags["ddpflow.trial"]): r for r in runs if "mlflow.parentRunId" in r.data.tags
    }
    return {
        "project": project,
        "flow_run_id": flow_run_id,
        "out": flow_run_logs(flow_run_id, "ddpflow: sweep"),
        "client": client,
        "parents": parents,
        "children": children,
    }


def _steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_one_parent_run_and_a_child_run_per_trial(swept) -> None:
    assert len(swept["parents"]) == 1
    parent = swept["parents"][0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["ddpflow.workload"] == "charlm-sweep"
    assert json.loads(parent.data.params["trials"]) == TRIALS
    children = swept["children"]
    assert sorted(children) == [0, 1, 2, 3, 4]
    assert {c.data.tags["mlflow.parentRunId"] for c in children.values()} == {parent.info.run_id}


def test_three_trials_complete_with_their_metrics(swept) -> None:
    client = swept["client"]
    for index in COMPLETED:
        run = swept["children"][index]
        assert run.info.status == "FINISHED", index
        assert run.data.params["lr"] == str(TRIALS[index]["lr"])
        val = _steps(client, run.info.run_id, "val_loss")
        elapsed = _steps(client, run.info.run_id, "elapsed_s")
        assert [s for s, _ in val] == [1, 2] and [s for s, _ in elapsed] == [1, 2]
        assert 0 < elapsed[0][1] < elapsed[1][1], "elapsed seconds accumulate"
        assert [s for s, _ in _steps(client, run.info.run_id, "epoch_train_loss")] == [1, 2]
        assert run.data.metrics["final_val_loss"] == pytest.approx(val[-1][1])


def test_invalid_trial_is_failed_naming_the_field_and_never_trained(swept) -> None:
    run = swept["children"][INVALID]
    assert run.info.status == "FAILED"
    assert "trials[4].lr=-1: must be > 0" in run.data.tags["ddpflow.error"]
    assert run.data.tags["ddpflow.failure"] == "invalid"
    assert run.data.metrics == {}
    assert "trial-4 rejected" in swept["out"]


def test_trial_crashing_mid_training_is_failed_with_its_error(swept) -> None:
    run = swept["children"][CRASHED]
    assert run.info.status == "FAILED"
    assert "InjectedFault" in run.data.tags["ddpflow.error"]
    assert run.data.tags["ddpflow.failure"] == "crash"
    assert [s for s, _ in _steps(swept["client"], run.info.run_id, "val_loss")] == [1]


def test_a_crashed_trial_frees_its_worker_for_a_queued_trial(swept) -> None:
    # docs/sweeps.md "Failures stay local": a trial that crashes frees its workers.
    client, children = swept["client"], swept["children"]
    crashed = children[CRASHED]
    crashed_end = _training_interval(client, crashed.info.run_id)[1]
    # Trials 0 and 1 start on the two workers; 2 and 3 queue until a worker is given back.
    queued = [children[i] for i in (2, 3)]
    assert all(r.info.status == "FINISHED" for r in queued)
    reused = [
        r for r in queued if r.data.tags["ddpflow.workers"] == crashed.data.tags["ddpflow.workers"]
    ]
    assert reused, "no queued trial ran on the worker of the crashed trial"
    for run in reused:
        assert _training_interval(client, run.info.run_id)[0] > crashed_end


def _training_interval(client: MlflowClient, run_id: str) -> tuple[int, int]:
    # From the first logged step to the last epoch's validation: the run's own end time
    # moves when the best trial's model is logged to it after the sweep.
    first = min(m.timestamp for m in client.get_metric_history(run_id, "train_loss"))
    last = max(m.timestamp for m in client.get_metric_history(run_id, "val_loss"))
    return first, last


def test_trials_ran_concurrently_but_never_more_than_the_workers(swept) -> None:
    client = swept["client"]
    trained = [swept["children"][i] for i in (CRASHED, *COMPLETED)]
    events = []
    for run in trained:
        start, end = _training_interval(client, run.info.run_id)
        events += [(start, 1), (end, -1)]
    running, peak = 0, 0
    for _, change in sorted(events):
        running += change
        peak = max(peak, running)
    assert peak == 2, "two workers: two trials at once, the others queued"
    workers = [run.data.tags["ddpflow.workers"] for run in trained]
    assert len(set(workers)) == 2, workers


def test_plots_are_artifacts_of_the_parent_run(swept) -> None:
    client, parent = swept["client"], swept["parents"][0]
    paths = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/loss_vs_epoch.png", "sweep/loss_vs_elapsed.png", "sweep/trials.json"} <= paths
    for name in ("loss_vs_epoch.png", "loss_vs_elapsed.png"):
        local = client.download_artifacts(parent.info.run_id, f"sweep/{name}")
        with open(local, "rb") as f:
            assert f.read(8) == PNG_MAGIC


def test_best_trial_is_registered_tagged_and_promoted(swept) -> None:
    client = swept["client"]
    completed = [swept["children"][i] for i in COMPLETED]
    best = min(completed, key=lambda r: r.data.metrics["final_val_loss"])
    versions = client.search_model_versions(f"name='{MODEL}'")
    assert [v.run_id for v in versions] == [best.info.run_id]
    assert best.data.tags["ddpflow.retrain.promoted"] == "True"  # the retraining rule ran
    assert client.get_model_version_by_alias(MODEL, "champion").version == versions[0].version
    assert swept["parents"][0].data.tags["ddpflow.best_run_id"] == best.info.run_id
    assert f"run {best.info.run_id}" in swept["out"]


def test_ranking_is_a_prefect_table_artifact(swept) -> None:
    artifacts = flow_run_records(swept["flow_run_id"])["artifacts"]
    (ranking,) = [a for a in artifacts if a["key"] == "charlm-sweep"]
    assert ranking["type"] == "table"
    table = json.dumps(ranking["data"])
    for run in swept["children"].values():
        assert run.info.run_id in table
    assert "trials[4].lr=-1: must be > 0" in table


def test_a_sweep_where_every_trial_fails_fails_with_a_failed_parent(
    flow_services, monkeypatch, tmp_path
) -> None:
    # docs/sweeps.md "Failures stay local": the sweep fails only if no trial completes.
    # The first trial crashes after one epoch, the second is invalid.
    trials = [{"lr": FAULTY_LR}, {"lr": -1}]
    state = sweep(tmp_path, flow_services, monkeypatch, trials=trials)
    assert state.is_failed(), state
    assert "no trial completed" in state.message
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "FAILED"
    assert sorted(r.info.status for r in runs if r is not parent) == ["FAILED", "FAILED"]
    assert not client.search_model_versions(f"name='{MODEL}'"), "nothing to register"
    assert parent.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)


def test_a_trial_can_be_a_ddp_group_of_two_workers(flow_services, monkeypatch, tmp_path) -> None:
    trials = [{"lr": 0.01, "epochs": 1}]
    state = sweep(tmp_path, flow_services, monkeypatch, trials=trials, ranks_per_trial=2)
    assert state.is_completed(), state
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    child = client.search_runs([experiment.experiment_id], "tags.`ddpflow.trial` = '0'")[0]
    assert child.info.status == "FINISHED"
    assert child.data.params["world_size"] == "2"
    assert len(child.data.tags["ddpflow.workers"].split()) == 2
    output = flow_run_logs(state.state_details.flow_run_id, "at a time on")
    assert "up to 1 at a time on 2 workers" in output


def test_ranks_per_trial_larger_than_the_cluster_fails_before_any_work(
    flow_services, monkeypatch, tmp_path
) -> None:
    state = sweep(tmp_path, flow_services, monkeypatch, trials=TRIALS, ranks_per_trial=3)
    with pytest.raises(ParameterError) as failed:
        state.result()
    assert "ranks_per_trial=3" in str(failed.value)
    assert "DDPFLOW_DASK_WORKERS" in str(failed.value)
    assert not (tmp_path / "artifacts").exists()


def test_trials_show_their_progress_datasets_and_the_sweep_links(swept) -> None:
    # docs/inspecting.md: each trial has a progress artifact (100 % when it completed), its
    # child run logs its datasets, and the sweep links the best run and its version.
    artifacts = {a["key"]: a for a in flow_run_records(swept["flow_run_id"])["artifacts"]}
    for trial in COMPLETED:
        progress = artifacts[f"charlm-trial-{trial}-progress"]
        assert progress["type"] == "progress" and float(progress["data"]) == 100.0, progress
        inputs = swept["children"][trial].inputs.dataset_inputs
        assert {i.dataset.digest for i in inputs} and len(inputs) == 2
    crashed = artifacts[f"charlm-trial-{CRASHED}-progress"]  # crashes after epoch 1
    assert crashed["description"].startswith(f"trial {CRASHED}: failed at epoch 1"), crashed
    best = swept["parents"][0].data.tags["ddpflow.best_run_id"]
    assert best in artifacts["charlm-sweep-mlflow"]["data"]
