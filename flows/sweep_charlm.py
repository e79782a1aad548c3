"""Many pet-name models at once: a hyperparameter sweep over (batch size, lr, sizes, ...).

Trials run concurrently, each on its own Dask worker (or a DDP group of `ranks_per_trial`
workers); the others queue. One MLflow parent run, one child run per trial, plots and a
ranking table; the best trial's model is registered (and promoted when asked).

Run it:
`python -m flows.sweep_charlm --grid '{"batch_size": [512, 2048], "lr": [0.001, 0.01]}'`
"""

from __future__ import annotations

if __name__ == "__main__":
    # A command line: the embedded API and the cluster start while the imports below load.
    from ddpflow.integrations.prefect.early_api import start_services

    start_services()

import json
from typing import Any

import optuna
from prefect import flow
from prefect.runtime import flow_run

from ddpflow.config import Settings
from ddpflow.distributed.planning import PlanError
from ddpflow.integrations.prefect.flow_client import current_dask_client
from ddpflow.integrations.prefect.task_runner import dask_task_runner
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import log_datasets
from ddpflow.tracking.loggers import MlflowLogger, RunRef
from ddpflow.tracking.run import default_artifact_location, end_run, failed_on_error, start_run
from ddpflow.training.result import TrainResult
from ddpflow.workloads.charlm.job import CharLMTrainJob
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
from ddpflow.workloads.sweep.report import best, log_to_parent, plots, table_rows
from ddpflow.workloads.sweep.space import parse_space
from flows.charlm_pipeline import corpus_datasets
from flows.cli import run_cli
from flows.inspection import publish_mlflow_links, run_identity, run_origin, tag_flow_run
from flows.params import ParameterError, SweepParams
from flows.preflight import rank_workers, run_preflight
from flows.search.resume import (
    PARENT_ATTR,
    STUDY_TAG,
    kept_outcomes,
    kill_interrupted_runs,
    take_over,
)
from flows.search.run import log_study, max_epochs, run_search, search_rows
from flows.search.storage import StudyStorageError, study_storage
from flows.search.study import StudyDesk, make_study
from flows.summary import mlflow_ui_hint, print_last
from flows.sweep_summary import SweepSummary
from tasks.charlm import download_corpus, format_training_data
from tasks.registration import register_trained
from tasks.retrain import score_and_promote
from tasks.search import train_search_trial
from tasks.sweep import TABLE_KEY, train_trial
from tasks.tables import publish_table

WORKLOAD = "charlm-sweep"
RESUMED_FROM_TAG = "ddpflow.resumed_from"  # a resumed search's parent run: the one before
TRIAL_DEFAULTS = ("epochs", "batch_size", "lr", "hidden_size", "num_layers", "dropout", "seed")


@flow(name="sweep-charlm", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def sweep_charlm(sweep: SweepParams = SweepParams()) -> SweepSummary:  # noqa: B008 - frozen
    """Train one pet-name model per trial, concurrently on the Dask cluster, and compare them."""
    settings = Settings.from_env()
    tag_flow_run(WORKLOAD)
    specs = _plan_trials(sweep)
    # Pre-flight before any download: enough workers for one trial, then store and tracking.
    workers = _cluster_workers(sweep.ranks_per_trial)
    run_preflight(settings, sweep.ranks_per_trial)
    study = _open_study(sweep, settings) if sweep.search is not None else None
    setup = _start_sweep(sweep, settings, specs)
    parent = setup.parent
    with failed_on_error(parent):
        if study is not None:
            outcomes = _run_search(study, setup, workers, sweep)
        else:
            outcomes = _run_trials(specs, setup, workers, sweep)
        summary = _compare_and_register(outcomes, parent, sweep, setup.corpus.val_uri)
    end_run(parent, failed=summary.num_completed == 0)
    if summary.best_run_id is not None:
        best_run = RunRef(parent.tracking_uri, summary.best_run_id)
        publish_mlflow_links(
            best_run, "charlm-sweep-mlflow", sweep.model_name, summary.model_version
        )
    hint = mlflow_ui_hint(settings.tracking_uri, parent.run_id, parent.experiment_id)
    print_last(summary.render(hint))
    if summary.num_completed == 0:
        raise RuntimeError(f"no trial completed; see the table above and MLflow {parent.run_id}")
    return summary


def _plan_trials(params: SweepParams) -> list[TrialSpec]:
    """The grid's or the list's trials; none for a search (its study asks them as it goes,
    and SweepParams has checked its space)."""
    if params.search is not None:
        return []
    defaults = {name: getattr(params, name) for name in TRIAL_DEFAULTS}
    try:
        return build_trials(params.grid, params.trials, defaults)
    except SweepConfigError as error:
        raise ParameterError(f"invalid sweep: {error}") from None


def _cluster_workers(ranks_per_trial: int) -> list[str]:
    workers = rank_workers(ranks_per_trial)  # GPU workers only when ranks ask for a GPU
    if ranks_per_trial > len(workers):
        raise ParameterError(
            f"ranks_per_trial={ranks_per_trial} needs {ranks_per_trial} Dask workers per trial "
            f"but the cluster has {len(workers)}; lower ranks_per_trial or add workers "
            "(DDPFLOW_DASK_WORKERS for the local cluster)"
        )
    return workers


def _start_sweep(params: SweepParams, settings: Settings, specs: list[TrialSpec]) -> SweepSetup:
    """Download and format the corpus once for all trials, then open the parent run."""
    raw = download_corpus.submit(params.source, settings.artifact_root).result()
    corpus = format_training_data.submit(
        raw.uri, settings.artifact_root, params.holdout_fraction
    ).result()
    print(f"corpus: {corpus.num_train_samples} train / {corpus.num_val_samples} holdout samples")
    artifact_location = default_artifact_location(settings.tracking_uri, settings.mlflow_artifacts)
    flow_run_id = str(flow_run.get_id())
    datasets = corpus_datasets(corpus, params.source)
    origin = run_origin()
    what = (
        f"A search of {params.n_trials} pet-name trials ({params.sampler}, {params.pruner})"
        if params.search is not None
        else f"A sweep of {len(specs)} pet-name trials"
    )
    run_name, identity_tags = run_identity(origin, f"sweep-{flow_run_id}", what, datasets)
    parent = start_run(
        settings.tracking_uri,
        params.experiment,
        run_name=run_name,
        params=_parent_params(params, specs, raw.sha256, corpus.num_train_samples),
        tags={"prefect.flow_run_id": flow_run_id, "ddpflow.workload": WORKLOAD, **identity_tags},
        artifact_location=artifact_location,
    )
    log_datasets(parent, datasets)
    return SweepSetup(
        corpus=corpus,
        parent=parent,
        experiment=params.experiment,
        artifact_root=settings.artifact_root,
        artifact_location=artifact_location,
        keep_last=params.keep_last,
        rank_resources=settings.rank_resources,
        params={
            "source": redact_url(params.source),
            "data_sha256": raw.sha256,
            "world_size": params.ranks_per_trial,
        },
        tags={
            "prefect.flow_run_id": flow_run_id,
            "ddpflow.workload": "charlm-trial",
            **origin.tags(),
        },
        datasets=datasets,
    )


def _parent_params(
    params: SweepParams, specs: list[TrialSpec], data_sha256: str, num_train_samples: int
) -> dict[str, Any]:
    chosen = {"grid": params.grid} if params.grid is not None else {"trials": params.trials}
    if params.search is not None:
        chosen = {"search": params.search}
    return {
        **params.model_dump(exclude={"grid", "trials", "search"}),
        **{k: json.dumps(v) for k, v in chosen.items()},
        "source": redact_url(params.source),
        "num_trials": params.n_trials if params.search is not None else len(specs),
        "data_sha256": data_sha256,
        "num_train_samples": num_train_samples,
    }


def _eligible_workers() -> list[str]:
    """The workers that may run trial ranks now (the slots follow restarts with it)."""
    try:
        return _cluster_workers(ranks_per_trial=1)
    except (ParameterError, PlanError):  # none right now: a restart may be under way
        return []


def _run_trials(
    specs: list[TrialSpec], setup: SweepSetup, workers: list[str], params: SweepParams
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


def _open_study(params: SweepParams, settings: Settings) -> optuna.Study:
    """The search's study, new or resumed, in its journal in the artifact root
    (flows.search.storage); a named study where none can be stored is refused here."""
    name = params.study_name or f"charlm-search-{flow_run.get_id()}"
    try:
        storage = study_storage(settings.artifact_root, name, named=params.study_name is not None)
    except StudyStorageError as error:
        raise ParameterError(str(error)) from None
    space = parse_space(params.search)
    return make_study(
        params.sampler,
        params.pruner,
        params.seed,
        params.min_epochs,
        params.eta,
        max_epochs(space, params.epochs),
        study_name=name,
        storage=storage,
    )


def _run_search(
    study: optuna.Study, setup: SweepSetup, workers: list[str], params: SweepParams
) -> list[TrialOutcome]:
    """The study asks trials as workers free up, and prunes them (flows.search.run); a
    study that an earlier flow run left is resumed (flows.search.resume)."""
    space = parse_space(params.search)
    defaults = {name: getattr(params, name) for name in TRIAL_DEFAULTS}
    resumed = take_over(study)
    kill_interrupted_runs(
        setup.parent.tracking_uri, params.experiment, study.study_name, resumed.interrupted
    )
    links = {STUDY_TAG: study.study_name}
    if resumed.previous_parent:
        links[RESUMED_FROM_TAG] = resumed.previous_parent
    MlflowLogger(setup.parent).set_tags(links)
    study.set_user_attr(PARENT_ATTR, setup.parent.run_id)
    earlier = kept_outcomes(resumed, defaults, setup.parent.tracking_uri)
    if resumed.done or resumed.interrupted:
        print(
            f"study {study.study_name} resumed: {resumed.done} trials kept, "
            f"{len(resumed.interrupted)} interrupted ones asked again"
        )
    desk = StudyDesk(study, space)
    slots = WorkerSlots(workers, current=_eligible_workers)  # follows restarted workers
    print(
        f"search: {params.n_trials} trials ({params.sampler} sampler, {params.pruner} pruner), "
        f"up to {slots.max_concurrent(params.ranks_per_trial)} at a time on {len(workers)} "
        f"workers ({params.ranks_per_trial} rank(s) each)"
    )

    def launch(
        number: int, job: CharLMTrainJob, assigned: list[str], verdicts: Verdicts, referee: Any
    ) -> TrainResult:
        return train_search_trial(
            number, job, assigned, params.rank_timeout_s, setup.rank_resources, verdicts, referee
        )

    outcomes = run_search(
        desk,
        defaults,
        params.n_trials,
        setup,
        slots,
        params.ranks_per_trial,
        current_dask_client(),
        launch,
        verdict_wait_s=_verdict_wait_s(params),
        already_done=resumed.done,
    )
    outcomes = sorted([*earlier, *outcomes], key=lambda o: o.spec.index)
    log_study(setup.parent, desk, outcomes)
    return outcomes


def _verdict_wait_s(params: SweepParams) -> float:
    """How long a trial's rank 0 waits for the study's verdict at an epoch's end: a quarter of
    the rank timeout, at most 30 s; with no pruner, not at all."""
    return 0.0 if params.pruner == "none" else min(DEFAULT_WAIT_S, params.rank_timeout_s / 4)


def _compare_and_register(
    outcomes: list[TrialOutcome], parent: RunRef, params: SweepParams, val_uri: str
) -> SweepSummary:
    rows = search_rows(outcomes) if params.search is not None else table_rows(outcomes)
    log_to_parent(parent, outcomes, plots(outcomes))
    publish_table(
        rows,
        TABLE_KEY,
        f"pet-name sweep, trials ranked by validation loss (MLflow {parent.run_id})",
    )
    top = best(outcomes)
    version = decision = None
    if top is not None and top.checkpoint_uri is not None:
        best_run = RunRef(parent.tracking_uri, top.run_id)
        version = register_trained("charlm", best_run, top.checkpoint_uri, params.model_name)
        if params.promote:
            # The retraining rule: champion and challenger scored on the same fixed holdout.
            decision = score_and_promote.submit(
                best_run, params.model_name, version, val_uri, 0.0
            ).result()
    return SweepSummary(
        parent_run_id=parent.run_id,
        rows=rows,
        num_completed=sum(o.completed for o in outcomes),
        best_run_id=top.run_id if top else None,
        best_val_loss=top.final_val_loss if top else None,
        model_name=params.model_name,
        model_version=version,
        promotion=decision.reason if decision else None,
        promoted=bool(decision and decision.promoted),
        table_key=TABLE_KEY,
    )


if __name__ == "__main__":
    run_cli(sweep_charlm)
