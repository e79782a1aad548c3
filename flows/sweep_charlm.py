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

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from ddpflow.config import Settings
from ddpflow.integrations.prefect.task_runner import dask_task_runner
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import log_datasets
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import default_artifact_location, end_run, failed_on_error, start_run
from ddpflow.workloads.sweep import SweepSetup, TrialOutcome, TrialSpec
from ddpflow.workloads.sweep.report import best, log_to_parent, plots, table_rows
from flows.charlm_pipeline import corpus_datasets
from flows.cli import run_cli
from flows.inspection import publish_mlflow_links, run_identity, run_origin, tag_flow_run
from flows.params import SweepParams
from flows.preflight import run_preflight
from flows.search.flow import (
    cluster_workers,
    describe,
    open_study,
    parent_params,
    plan_trials,
    run_study,
    run_trials,
)
from flows.search.run import search_rows
from flows.summary import mlflow_ui_hint, print_last
from flows.sweep_summary import SweepSummary
from tasks.charlm import download_corpus, format_training_data
from tasks.registration import register_trained
from tasks.retrain import score_and_promote
from tasks.sweep import TABLE_KEY
from tasks.tables import publish_table

WORKLOAD = "charlm-sweep"


@flow(name="sweep-charlm", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def sweep_charlm(sweep: SweepParams = SweepParams()) -> SweepSummary:  # noqa: B008 - frozen
    """Train one pet-name model per trial, concurrently on the Dask cluster, and compare them."""
    settings = Settings.from_env()
    tag_flow_run(WORKLOAD)
    specs = plan_trials(sweep)
    # Pre-flight before any download: enough workers for one trial, then store and tracking.
    workers = cluster_workers(sweep.ranks_per_trial)
    run_preflight(settings, sweep.ranks_per_trial)
    study = open_study(sweep, settings, "charlm") if sweep.search is not None else None
    setup = _start_sweep(sweep, settings, specs)
    parent = setup.parent
    with failed_on_error(parent):
        if study is not None:
            outcomes = run_study(study, setup, workers, sweep, "charlm")
        else:
            outcomes = run_trials(specs, setup, workers, sweep)
        assert setup.corpus is not None  # a pet-name sweep's setup holds its corpus
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
    what = describe(params, specs, "pet-name")
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
    return {
        **parent_params(params, specs),
        "source": redact_url(params.source),
        "data_sha256": data_sha256,
        "num_train_samples": num_train_samples,
    }


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
