"""What the sweep flows (sweep-charlm, sweep-images) do alike once their data is ready: the
cluster's workers for trials, the queued trials of a grid or a list, and a search's study,
new or resumed, run to its budget.

A grid or a list is the grid sampler with no pruner, asked in its own order: its trials are
planned up front (`plan_trials`) and queued on the free workers (`run_trials`). A search's
study asks them as workers free up (`open_study`, `run_study`; flows.search.run). Both run
each trial as the same Prefect task on its own workers, whatever the workload: the trial's
job says which training its ranks run (ddpflow.workloads.sweep.trial).
"""

from __future__ import annotations

import json
from typing import Any

import optuna
from prefect.runtime import flow_run

from ddpflow.config import Settings
from ddpflow.distributed.planning import PlanError
from ddpflow.integrations.prefect.flow_client import current_dask_client
from ddpflow.tracking.loggers import MlflowLogger
from ddpflow.training.result import TrainResult
from ddpflow.workloads.sweep import (
    SweepConfigError,
    SweepSetup,
    TrialOutcome,
    TrialSpec,
    WorkerSlots,
    build_trials,
    reject_trial,
    run_queued,
    run_trial,
)
from ddpflow.workloads.sweep.pruning import DEFAULT_WAIT_S, Verdicts
from ddpflow.workloads.sweep.trial import TrialJob
from flows.params import AnySweepParams, ParameterError
from flows.preflight import rank_workers
from flows.search.resume import (
    PARENT_ATTR,
    STUDY_TAG,
    kept_outcomes,
    kill_interrupted_runs,
    spent_epochs,
    take_over,
)
from flows.search.run import log_study, max_epochs, run_search
from flows.search.storage import StudyStorageError, study_storage
from flows.search.study import StudyDesk, make_study
from tasks.search import train_search_trial
from tasks.sweep import train_trial

RESUMED_FROM_TAG = "ddpflow.resumed_from"  # a resumed search's parent run: the one before


def plan_trials(params: AnySweepParams) -> list[TrialSpec]:
    """The grid's or the list's trials; none for a search (its study asks them as it goes,
    and the parameters have checked its space)."""
    if params.search is not None:
        return []
    try:
        return build_trials(
            params.grid, params.trials, params.trial_defaults(), params.trial_fields
        )
    except SweepConfigError as error:
        raise ParameterError(f"invalid sweep: {error}") from None


def cluster_workers(ranks_per_trial: int) -> list[str]:
    workers = rank_workers(ranks_per_trial)  # GPU workers only when ranks ask for a GPU
    if ranks_per_trial > len(workers):
        raise ParameterError(
            f"ranks_per_trial={ranks_per_trial} needs {ranks_per_trial} Dask workers per trial "
            f"but the cluster has {len(workers)}; lower ranks_per_trial or add workers "
            "(DDPFLOW_DASK_WORKERS for the local cluster)"
        )
    return workers


def _eligible_workers() -> list[str]:
    """The workers that may run trial ranks now (the slots follow restarts with it)."""
    try:
        return cluster_workers(ranks_per_trial=1)
    except (ParameterError, PlanError):  # none right now: a restart may be under way
        return []


def describe(params: AnySweepParams, specs: list[TrialSpec], what: str) -> str:
    """The parent run's description: `what` its trials train."""
    if params.search is None:
        return f"A sweep of {len(specs)} {what} trials"
    budget = f", {params.budget_epochs} trial-epochs" if params.budget_epochs else ""
    return (
        f"A search of {params.trials_to_ask()} {what} trials{budget} "
        f"({params.sampler}, {params.pruner})"
    )


def parent_params(params: AnySweepParams, specs: list[TrialSpec]) -> dict[str, Any]:
    """The sweep's own parameters for its parent run (the trials as JSON, how many)."""
    chosen = {"grid": params.grid} if params.grid is not None else {"trials": params.trials}
    if params.search is not None:
        chosen = {"search": params.search}
    return {
        **params.model_dump(exclude={"grid", "trials", "search"}),
        **{k: json.dumps(v) for k, v in chosen.items()},
        "num_trials": params.trials_to_ask() if params.search is not None else len(specs),
    }


def run_trials(
    specs: list[TrialSpec], setup: SweepSetup, workers: list[str], params: AnySweepParams
) -> list[TrialOutcome]:
    """Reject invalid trials at once, then run the valid ones as workers free up."""
    rejected = [reject_trial(s, setup) for s in specs if not s.valid]
    for outcome in rejected:
        print(f"{outcome.spec.name} rejected: {outcome.error}")
    valid = [s for s in specs if s.valid]
    slots = WorkerSlots(workers, current=_eligible_workers)  # follows restarted workers
    print(
        f"sweep: {len(valid)} trials to train, up to "
        f"{slots.max_concurrent(params.ranks_per_trial)} at a time on {len(workers)} workers "
        f"({params.ranks_per_trial} rank(s) each)"
    )

    def run_one(spec: TrialSpec, assigned: list[str]) -> TrialOutcome:
        assert spec.config is not None  # only valid trials run
        print(f"{spec.name} ({spec.config.label()}) starts on {', '.join(assigned)}")
        outcome = run_trial(
            spec,
            assigned,
            setup,
            lambda job, w: train_trial(
                spec.index, job, w, params.rank_timeout_s, setup.rank_resources
            ),
        )
        result = f"val loss {outcome.final_val_loss:.4f}" if outcome.completed else outcome.error
        print(f"{spec.name} {outcome.status}: {result}")
        return outcome

    trained = run_queued(valid, slots, params.ranks_per_trial, run_one)
    return sorted([*rejected, *trained], key=lambda o: o.spec.index)


def open_study(params: AnySweepParams, settings: Settings, workload: str) -> optuna.Study:
    """The search's study, new or resumed, in its journal in the artifact root
    (flows.search.storage); a named study where none can be stored is refused here."""
    name = params.study_name or f"{workload}-search-{flow_run.get_id()}"
    try:
        storage = study_storage(settings.artifact_root, name, named=params.study_name is not None)
    except StudyStorageError as error:
        raise ParameterError(str(error)) from None
    space = params.space()
    return make_study(
        params.sampler,
        params.pruner,
        params.seed,
        params.min_epochs,
        params.eta,
        max_epochs(space, params.epochs),
        study_name=name,
        storage=storage,
        space=space,
    )


def run_study(
    study: optuna.Study,
    setup: SweepSetup,
    workers: list[str],
    params: AnySweepParams,
    workload: str,
) -> list[TrialOutcome]:
    """The study asks trials as workers free up, and prunes them (flows.search.run), until
    its trials or trial-epochs budget is reached; a study that an earlier flow run left is
    resumed (flows.search.resume): its kept trials count, their epochs too."""
    space = params.space()
    defaults = params.trial_defaults()
    resumed = take_over(study)
    kill_interrupted_runs(
        setup.parent.tracking_uri, setup.experiment, study.study_name, resumed.interrupted
    )
    links = {STUDY_TAG: study.study_name}
    if resumed.previous_parent:
        links[RESUMED_FROM_TAG] = resumed.previous_parent
    MlflowLogger(setup.parent).set_tags(links)
    study.set_user_attr(PARENT_ATTR, setup.parent.run_id)
    earlier = kept_outcomes(resumed, defaults, setup.parent.tracking_uri, params.trial_fields)
    spent_before = spent_epochs(earlier)
    if resumed.done or resumed.interrupted:
        print(
            f"study {study.study_name} resumed: {resumed.done} trials kept "
            f"({spent_before} trial-epochs), {len(resumed.interrupted)} interrupted ones "
            "asked again"
        )
    desk = StudyDesk(study, space)
    slots = WorkerSlots(workers, current=_eligible_workers)  # follows restarted workers
    n_trials = params.trials_to_ask()
    budget = f", at most {params.budget_epochs} trial-epochs" if params.budget_epochs else ""
    print(
        f"search: {n_trials} trials{budget} ({params.sampler} sampler, {params.pruner} "
        f"pruner), up to {slots.max_concurrent(params.ranks_per_trial)} at a time on "
        f"{len(workers)} workers ({params.ranks_per_trial} rank(s) each)"
    )

    def launch(
        number: int, job: TrialJob, assigned: list[str], verdicts: Verdicts, referee: Any
    ) -> TrainResult:
        return train_search_trial(
            number, job, assigned, params.rank_timeout_s, setup.rank_resources, verdicts, referee
        )

    outcomes = run_search(
        desk,
        defaults,
        n_trials,
        setup,
        slots,
        params.ranks_per_trial,
        current_dask_client(),
        launch,
        verdict_wait_s=_verdict_wait_s(params),
        already_done=resumed.done,
        budget_epochs=params.budget_epochs,
        spent_before=spent_before,
        progress_key=f"{workload}-search-progress",
    )
    outcomes = sorted([*earlier, *outcomes], key=lambda o: o.spec.index)
    log_study(setup.parent, desk, outcomes, params.budget_epochs)
    return outcomes


def _verdict_wait_s(params: AnySweepParams) -> float:
    """How long a trial's rank 0 waits for the study's verdict at an epoch's end: a quarter of
    the rank timeout, at most 30 s; with no pruner, not at all."""
    if params.pruner == "none":
        return 0.0
    return min(DEFAULT_WAIT_S, params.rank_timeout_s / 4)
