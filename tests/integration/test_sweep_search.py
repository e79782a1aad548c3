"""The sweep's search mode end to end: an Optuna study with ASHA on a 2-worker LocalCluster.

Six trials of 4 epochs, ASHA with r = 1 and eta = 2 (rungs after epochs 1, 2 and 4): trials
the pruner stops end at their rung and free their worker for the next trial at once, so the
search spends fewer trial-epochs than the grid of the same six trials (24). One sampled
learning rate is trial_faults' FAULTY_LR, whose trial crashes after its first epoch: it is
FAILED in the study and in MLflow, and the search goes on. The flow runs in the test's
process on the module's flow_services, whose workers preload the fault injection.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from ddpflow.workloads.sweep.space import parse_space
from flows.params import SweepParams
from flows.search.study import StudyDesk, make_study
from flows.sweep_charlm import sweep_charlm
from tests.helpers.charlm_runs import small_corpus
from tests.helpers.in_process import run_in_process
from tests.helpers.prefect_reads import flow_run_logs, flow_run_records
from tests.helpers.projects import project_env
from tests.helpers.trial_faults import FAULTY_LR, PRELOAD_ENV

pytestmark = pytest.mark.integration

EXPERIMENT = "search-test"
MODEL = "search-test-model"
N_TRIALS, EPOCHS, ETA = 6, 4, 2
# Eight values, and a seed whose six trials ask six of them: a point asked again is told the
# earlier trial's result without training (flows.search.run), and here every trial trains.
SPACE = {"lr": {"choices": [FAULTY_LR, 0.0001, 0.0003, 0.001, 0.002, 0.003, 0.01, 0.03]}}
# From the end of a pruned trial's rung epoch to the next trial's first step on its worker:
# the flow ends the run, tells the study, asks the next trial, opens its run and launches it.
NEXT_TRIAL_WITHIN_S = 20.0


def first_lrs(sampler: Any, seed: int, space: dict, n: int) -> list[float]:
    """The learning rates of the study's first `n` asks: the asks are seeded and in order, so
    the flow's study asks the same."""
    desk = StudyDesk(make_study(sampler, "asha", seed, 1, ETA, EPOCHS), parse_space(space))
    return [desk.ask()[1]["lr"] for _ in range(n)]


def crash_once_seed() -> int:
    """A seed whose first trials ask distinct points, FAULTY_LR as the second or third (trials
    are asked after it). TPE samples its first ten trials at random, whatever was told."""
    for seed in range(2000):
        lrs = first_lrs("tpe", seed, SPACE, N_TRIALS)
        if len(set(lrs)) == N_TRIALS and FAULTY_LR in lrs[1:3]:
            return seed
    raise AssertionError("no seed samples the crash once")


@pytest.fixture(scope="module")
def flow_services_env() -> dict[str, str]:
    return PRELOAD_ENV


@pytest.fixture(scope="module")
def searched(flow_services, tmp_path_factory) -> dict:
    project = tmp_path_factory.mktemp("search")
    params = SweepParams(
        search=SPACE,
        n_trials=N_TRIALS,
        pruner="asha",
        min_epochs=1,
        eta=ETA,
        seed=crash_once_seed(),
        epochs=EPOCHS,
        hidden_size=16,
        num_layers=1,
        batch_size=4096,
        source=str(small_corpus(8000)),
        experiment=EXPERIMENT,
        model_name=MODEL,
    )
    with pytest.MonkeyPatch.context() as patch:
        state = run_in_process(
            sweep_charlm, project, flow_services, patch, sweep=params, return_state=True
        )
    assert state.is_completed(), state
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    flow_run_id = state.state_details.flow_run_id
    return {
        "client": client,
        "parent": parent,
        "children": {int(r.data.tags["ddpflow.trial"]): r for r in children},
        "flow_run_id": flow_run_id,
        "out": flow_run_logs(flow_run_id, "ddpflow: sweep"),
    }


def _epochs(client: MlflowClient, run: Any) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss"))


def _first_step_ms(client: MlflowClient, run: Any) -> int:
    # fit logs the group's world size before its first step.
    return min(m.timestamp for m in client.get_metric_history(run.info.run_id, "world_size"))


def _last_epoch_ms(client: MlflowClient, run: Any) -> int:
    return max(m.timestamp for m in client.get_metric_history(run.info.run_id, "val_loss"))


def _states(searched: dict) -> dict[int, str]:
    return {i: r.data.tags["ddpflow.trial_state"] for i, r in searched["children"].items()}


def test_every_asked_trial_has_a_child_run_with_its_state(searched) -> None:
    states = _states(searched)
    assert sorted(states) == list(range(N_TRIALS))
    assert set(states.values()) <= {"COMPLETE", "PRUNED", "FAILED"}
    assert list(states.values()).count("FAILED") == 1, states
    assert "PRUNED" in states.values(), states
    assert "COMPLETE" in states.values(), states


def test_pruned_trials_stop_at_their_rung(searched) -> None:
    client = searched["client"]
    rungs = {1, 2}  # r * eta^k below the last epoch: a trial's last epoch prunes nothing
    for run in searched["children"].values():
        state = run.data.tags["ddpflow.trial_state"]
        epochs = _epochs(client, run)
        if state == "PRUNED":
            at = int(run.data.tags["ddpflow.pruned_at_epoch"])
            assert at in rungs, at
            assert epochs == list(range(1, at + 1)), (at, epochs)
            assert run.info.status == "FINISHED"
            assert "final_val_loss" not in run.data.metrics
        elif state == "COMPLETE":
            assert epochs == list(range(1, EPOCHS + 1))
            assert "ddpflow.pruned_at_epoch" not in run.data.tags


def test_a_pruned_trial_frees_its_worker_for_the_next_trial_within_seconds(searched) -> None:
    client, children = searched["client"], list(searched["children"].values())
    gaps = []
    for pruned in (r for r in children if r.data.tags["ddpflow.trial_state"] == "PRUNED"):
        ended = _last_epoch_ms(client, pruned)
        worker = pruned.data.tags["ddpflow.workers"]
        later = [
            _first_step_ms(client, r)
            for r in children
            if r.data.tags["ddpflow.workers"] == worker and _first_step_ms(client, r) > ended
        ]
        if later:
            gaps.append((min(later) - ended) / 1000)
    print(f"pruned trial's rung end -> next trial's first step on its worker: {gaps} s")
    assert gaps, "no trial ran after a pruned one"
    assert max(gaps) < NEXT_TRIAL_WITHIN_S, gaps


def test_the_search_spends_fewer_trial_epochs_than_the_grid(searched) -> None:
    client, children = searched["client"], searched["children"].values()
    spent = sum(len(_epochs(client, r)) for r in children)
    # The grid of the same trials trains each for all its epochs; the crash costs it as much.
    grid = sum(
        len(_epochs(client, r)) if r.data.tags["ddpflow.trial_state"] == "FAILED" else EPOCHS
        for r in children
    )
    print(f"trial-epochs: {spent} (the grid of the same {N_TRIALS} trials: {grid})")
    assert spent < grid
    assert searched["parent"].data.metrics["trial_epochs"] == spent


def test_a_crashed_trial_is_failed_in_the_study_and_mlflow(searched) -> None:
    (crashed,) = [
        r for r in searched["children"].values() if r.data.tags["ddpflow.trial_state"] == "FAILED"
    ]
    assert crashed.info.status == "FAILED"
    assert float(crashed.data.params["lr"]) == FAULTY_LR
    assert "InjectedFault" in crashed.data.tags["ddpflow.error"]
    client, parent = searched["client"], searched["parent"]
    study = json.loads(
        Path(client.download_artifacts(parent.info.run_id, "sweep/study.json")).read_text()
    )
    (row,) = [t for t in study["trials"] if t["run_id"] == crashed.info.run_id]
    assert row["state"] == "FAILED"
    # The search went on: trials were asked after the crash.
    assert int(crashed.data.tags["ddpflow.optuna_trial"]) < N_TRIALS - 1


def test_the_parent_run_holds_the_best_trial_and_it_is_registered(searched) -> None:
    client, parent = searched["client"], searched["parent"]
    complete = [
        r for r in searched["children"].values() if r.data.tags["ddpflow.trial_state"] == "COMPLETE"
    ]
    lowest = min(r.data.metrics["final_val_loss"] for r in complete)
    (best,) = [r for r in complete if r.info.run_id == parent.data.tags["ddpflow.best_run_id"]]
    assert best.data.metrics["final_val_loss"] == lowest
    assert parent.data.metrics["best_value"] == pytest.approx(best.data.metrics["final_val_loss"])
    assert json.loads(parent.data.tags["ddpflow.best_params"]) == {
        "lr": float(best.data.params["lr"])
    }
    assert json.loads(parent.data.params["search"]) == SPACE
    for name in ("optimization_history.png", "parallel_coordinate.png"):  # Optuna's plots
        local = client.download_artifacts(parent.info.run_id, f"sweep/{name}")
        assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    versions = client.search_model_versions(f"name='{MODEL}'")
    assert [v.run_id for v in versions] == [best.info.run_id]


def test_prefect_ranks_the_trials_with_their_state_and_shows_progress(searched) -> None:
    artifacts = flow_run_records(searched["flow_run_id"])["artifacts"]
    (table,) = [a for a in artifacts if a["key"] == "charlm-sweep"]
    rows = table["data"] if isinstance(table["data"], list) else json.loads(table["data"])
    assert [r["state"] for r in rows][0] == "COMPLETE"  # ranked: the best first
    assert {r["state"] for r in rows} == set(_states(searched).values())
    (progress,) = [a for a in artifacts if a["key"] == "charlm-search-progress"]
    assert progress["data"] == 100.0
    assert f"{N_TRIALS}/{N_TRIALS} trials done" in progress["description"]
    assert "pruned" in searched["out"]


def test_a_trial_of_two_ranks_is_pruned_on_both(flow_services, monkeypatch, tmp_path) -> None:
    """With --ranks-per-trial 2 the ranks agree on rank 0's verdict: the second trial, far
    worse at the first rung, stops there on both ranks and the search ends."""
    good, bad = 0.03, 0.0003
    space = {"lr": {"choices": [good, bad]}}
    seed = next(s for s in range(100) if first_lrs("random", s, space, 2) == [good, bad])
    params = SweepParams(
        search=space,
        sampler="random",
        n_trials=2,
        eta=2,
        seed=seed,
        epochs=3,
        hidden_size=16,
        num_layers=1,
        batch_size=4096,
        ranks_per_trial=2,
        source=str(small_corpus(8000)),
        experiment=EXPERIMENT,
        model_name=MODEL,
    )
    state = run_in_process(
        sweep_charlm, tmp_path, flow_services, monkeypatch, sweep=params, return_state=True
    )
    assert state.is_completed(), state
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    children = {
        int(r.data.tags["ddpflow.trial"]): r
        for r in client.search_runs([experiment.experiment_id])
        if "mlflow.parentRunId" in r.data.tags
    }
    assert children[0].data.tags["ddpflow.trial_state"] == "COMPLETE"
    pruned = children[1]
    assert pruned.data.tags["ddpflow.trial_state"] == "PRUNED"
    assert pruned.data.tags["ddpflow.pruned_at_epoch"] == "1"
    assert _epochs(client, pruned) == [1]
    assert len(pruned.data.tags["ddpflow.workers"].split()) == 2


# A range: no point is asked twice, so every trial asked trains (and has a child run).
RESUME_SPACE = {"lr": {"low": 0.001, "high": 0.03, "log": True}}


def _one_trial_complete_and_one_training(project: Path, timeout_s: float) -> None:
    """Wait until the flow in `project` has told its study that a trial completed and another
    trial's child run has begun (running, no outcome yet): a kill then interrupts a trial that
    trained. Waiting for the first completion alone raced: on a fast machine both parallel
    trials completed within one poll and the kill caught only a trial asked, not yet started."""
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the store is being created or migrated
            experiment = client.get_experiment_by_name(EXPERIMENT)
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            trials = [r for r in runs if "ddpflow.optuna_trial" in r.data.tags]
            outcomes = {r.data.tags.get("ddpflow.trial_state") for r in trials}
            training = [r for r in trials if r.info.status == "RUNNING"]
            if "COMPLETE" in outcomes and any(
                "ddpflow.trial_state" not in r.data.tags for r in training
            ):
                return
        time.sleep(0.2)
    raise AssertionError(f"no trial completed with another training within {timeout_s} s")


def test_a_killed_search_resumes_with_the_same_study(
    flow_services, shared_prefect_server, monkeypatch, tmp_path
) -> None:
    """SIGKILL the flow's process once a trial completed and another trains, rerun with the
    same study name: the finished trials are kept, the interrupted ones asked again, the
    budget goes on."""
    project, name, n_trials = tmp_path / "project", "pets-resume", 4
    options = {
        "search": RESUME_SPACE,
        "study_name": name,
        "n_trials": n_trials,
        "sampler": "random",
        "pruner": "none",
        "epochs": 2,
        "hidden_size": 16,
        "num_layers": 1,
        "batch_size": 4096,
        "source": str(small_corpus(8000)),
        "experiment": EXPERIMENT,
        "model_name": MODEL,
    }
    argv = [sys.executable, "-m", "flows.sweep_charlm"]
    for key, value in options.items():
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        argv += [f"--{key.replace('_', '-')}", text]
    env = {
        **project_env(project),
        "DDPFLOW_DASK_ADDRESS": flow_services,
        "PREFECT_API_URL": shared_prefect_server,
    }
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(argv, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _one_trial_complete_and_one_training(project, timeout_s=240)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)

    path = project / "artifacts" / "studies" / f"{name}.journal"
    journal = JournalStorage(JournalFileBackend(str(path)))
    before = {t.number: t for t in optuna.load_study(study_name=name, storage=journal).trials}
    kept = [n for n, t in before.items() if t.state == TrialState.COMPLETE]
    interrupted = [n for n, t in before.items() if t.state == TrialState.RUNNING]
    assert kept and interrupted, (before, (tmp_path / "first.log").read_text()[-3000:])

    state = run_in_process(
        sweep_charlm,
        project,
        flow_services,
        monkeypatch,
        sweep=SweepParams(**options),
        return_state=True,
    )
    assert state.is_completed(), state
    after = optuna.load_study(study_name=name, storage=journal)
    assert after.user_attrs["ddpflow_interrupted"] == interrupted
    counted = [t for t in after.trials if t.number not in interrupted]
    assert len(counted) == n_trials and all(t.state == TrialState.COMPLETE for t in counted)
    reasked = {
        t.user_attrs["ddpflow_reasked_from"]: t
        for t in after.trials
        if "ddpflow_reasked_from" in t.user_attrs
    }
    assert sorted(reasked) == interrupted, "each interrupted trial is asked again, once"
    for number, trial in reasked.items():
        assert trial.params == before[number].params

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    parents.sort(key=lambda r: r.info.start_time)
    assert len(parents) == 2
    assert parents[1].data.tags["ddpflow.resumed_from"] == parents[0].info.run_id
    assert after.user_attrs["mlflow_parent_run_id"] == parents[1].info.run_id
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    for number in kept:  # never trained again
        (run,) = [r for r in children if r.data.tags["ddpflow.optuna_trial"] == str(number)]
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    # A trial asked just before the kill (as the first completed, its worker came free) may
    # not have begun its child run: there is none to end. One that trained has its run ended.
    ended = []
    for number in interrupted:
        mine = [r for r in children if r.data.tags["ddpflow.optuna_trial"] == str(number)]
        assert len(mine) <= 1, mine
        for run in mine:
            status = (run.info.status, run.data.tags["ddpflow.trial_state"])
            assert status == ("KILLED", "INTERRUPTED"), status
            ended.append(number)
    assert ended, "the trial that was training when the flow was killed has its run ended"
    study = json.loads(
        Path(client.download_artifacts(parents[1].info.run_id, "sweep/study.json")).read_text()
    )
    assert sorted(row["trial"] for row in study["trials"]) == sorted(t.number for t in counted)


def _children(client: MlflowClient, experiment: str) -> list[Any]:
    found = client.get_experiment_by_name(experiment)
    return [
        r for r in client.search_runs([found.experiment_id]) if "mlflow.parentRunId" in r.data.tags
    ]


def test_a_budget_in_trial_epochs_stops_the_asking_and_a_resume_counts_it(
    flow_services, monkeypatch, tmp_path
) -> None:
    """One trial at a time (two ranks each: the count is then exact), one epoch each, a
    budget of 3 trial-epochs beside a trials budget of 5: the budget is reached first, after
    the third trial, and no fourth is asked. The same study rerun with a budget of 4 counts
    the 3 epochs its kept trials spent and asks one trial more."""
    experiment, name = "budget-test", "pets-budget"
    options: dict[str, Any] = {
        "search": RESUME_SPACE,
        "study_name": name,
        "sampler": "random",
        "pruner": "none",
        "n_trials": 5,
        "budget_epochs": 3,
        "epochs": 1,
        "ranks_per_trial": 2,
        "hidden_size": 16,
        "num_layers": 1,
        "batch_size": 4096,
        "source": str(small_corpus(8000)),
        "experiment": experiment,
        "model_name": MODEL,
    }
    state = run_in_process(
        sweep_charlm, tmp_path, flow_services, monkeypatch, sweep=SweepParams(**options),
        return_state=True,
    )  # fmt: skip
    assert state.is_completed(), state
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    children = _children(client, experiment)
    # The trial-epochs in the child runs: three trials of one epoch, not n_trials' five.
    assert [_epochs(client, r) for r in children] == [[1]] * 3
    (parent,) = [
        r
        for r in client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        if "mlflow.parentRunId" not in r.data.tags
    ]
    assert parent.data.metrics["trial_epochs"] == 3
    assert parent.data.metrics["budget_used"] == 1.0
    assert parent.data.params["budget_epochs"] == "3"
    artifacts = flow_run_records(state.state_details.flow_run_id)["artifacts"]
    (progress,) = [a for a in artifacts if a["key"] == "charlm-search-progress"]
    assert progress["data"] == 100.0
    assert "3 trial-epochs spent of a budget of 3 (100 %)" in progress["description"]

    again = SweepParams(**{**options, "budget_epochs": 4})
    state = run_in_process(
        sweep_charlm, tmp_path, flow_services, monkeypatch, sweep=again, return_state=True
    )
    assert state.is_completed(), state
    path = tmp_path / "artifacts" / "studies" / f"{name}.journal"
    study = optuna.load_study(
        study_name=name, storage=JournalStorage(JournalFileBackend(str(path)))
    )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    children = _children(client, experiment)
    assert [_epochs(client, r) for r in children] == [[1]] * 4
    parents = [
        r
        for r in client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        if "mlflow.parentRunId" not in r.data.tags
    ]
    (resumed,) = [p for p in parents if "ddpflow.resumed_from" in p.data.tags]
    assert resumed.data.metrics["trial_epochs"] == 4  # the 3 kept and the 1 new
    trained_here = [c for c in children if c.data.tags["mlflow.parentRunId"] == resumed.info.run_id]
    assert len(trained_here) == 1
