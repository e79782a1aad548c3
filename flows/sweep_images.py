"""Many image classifiers at once: a hyperparameter sweep over (lr, batch size, frozen
backbone, augmentation, epochs, seed), from a grid, a list or an Optuna search.

The sweep-charlm machinery for the image workload (flows.search.flow): trials run
concurrently, each on its own Dask worker (or a DDP group of `ranks_per_trial` workers), the
others queue; one MLflow parent run, one child run per trial, plots and a ranking table by
validation loss; the best trial's model is registered. The folder is formatted once for all
trials (held in memory), as train-images formats it; unset `--source`: the digits demo.

Run it:
`python -m flows.sweep_images --epochs 2 --grid '{"lr": [0.001, 0.01], "augment": [true, false]}'`
"""

from __future__ import annotations

if __name__ == "__main__":
    # A command line: the embedded API and the cluster start while the imports below load.
    from ddpflow.integrations.prefect.early_api import start_services

    start_services()

from dataclasses import replace
from functools import partial

from prefect import flow
from prefect.runtime import flow_run

from ddpflow import storage
from ddpflow.config import Settings
from ddpflow.integrations.prefect.task_runner import dask_task_runner
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import log_datasets
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import default_artifact_location, end_run, failed_on_error, start_run
from ddpflow.training.speed.settings import PLAIN
from ddpflow.workloads.sweep import SweepSetup, TrialOutcome, TrialSpec
from ddpflow.workloads.sweep.config import IMAGE_FIELDS, ImageTrialConfig
from ddpflow.workloads.sweep.report import best, log_to_parent, plots, table_rows
from ddpflow.workloads.vision.config import ImageModelConfig
from ddpflow.workloads.vision.data import FormattedImages, ImageSpec
from ddpflow.workloads.vision.job import ImageTrainJob
from flows.cli import run_cli
from flows.inspection import publish_mlflow_links, run_identity, run_origin, tag_flow_run
from flows.params import ImageSweepParams
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
from flows.sweep_summary import IMAGE_COLUMNS, SweepSummary
from flows.train_images import image_datasets
from tasks.images import format_images, prepare_digits, prepare_weights
from tasks.registration import register_trained
from tasks.tables import publish_table

WORKLOAD = "images-sweep"
TABLE_KEY = "images-sweep"


@flow(name="sweep-images", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def sweep_images(sweep: ImageSweepParams = ImageSweepParams()) -> SweepSummary:  # noqa: B008 - frozen
    """Fine-tune one image classifier per trial, concurrently on the cluster, and compare them."""
    settings = Settings.from_env()
    tag_flow_run(WORKLOAD)
    specs = plan_trials(sweep)
    # Pre-flight before any formatting: enough workers for one trial, then store and tracking.
    workers = cluster_workers(sweep.ranks_per_trial)
    run_preflight(settings, sweep.ranks_per_trial)
    study = open_study(sweep, settings, "images") if sweep.search is not None else None
    setup = _start_sweep(sweep, settings, specs)
    parent = setup.parent
    with failed_on_error(parent):
        if study is not None:
            outcomes = run_study(study, setup, workers, sweep, "images")
        else:
            outcomes = run_trials(specs, setup, workers, sweep)
        summary = _compare_and_register(outcomes, parent, sweep)
    end_run(parent, failed=summary.num_completed == 0)
    if summary.best_run_id is not None:
        best_run = RunRef(parent.tracking_uri, summary.best_run_id)
        publish_mlflow_links(
            best_run, "images-sweep-mlflow", sweep.model_name, summary.model_version
        )
    hint = mlflow_ui_hint(settings.tracking_uri, parent.run_id, parent.experiment_id)
    print_last(summary.render(hint))
    if summary.num_completed == 0:
        raise RuntimeError(f"no trial completed; see the table above and MLflow {parent.run_id}")
    return summary


def _start_sweep(
    params: ImageSweepParams, settings: Settings, specs: list[TrialSpec]
) -> SweepSetup:
    """Format the folder and resolve the weights once for all trials, open the parent run."""
    source = params.source
    if source is None:
        digits = prepare_digits.submit(storage.join(settings.artifact_root, "data", "digits"))
        source = digits.result().uri
    data = format_images.submit(
        source,
        settings.artifact_root,
        ImageSpec(params.image_size, params.resize),
        params.val_fraction,
        params.seed,
        params.max_bad_fraction,
        params.max_image_mb,
    ).result()
    print(
        f"images: {len(data.classes)} classes, {data.num_train} train / {data.num_val} "
        f"validation, {len(data.bad)} unreadable file(s) skipped"
    )
    weights_uri = prepare_weights.submit(
        params.arch, params.weights, settings.artifact_root
    ).result()
    artifact_location = default_artifact_location(settings.tracking_uri, settings.mlflow_artifacts)
    flow_run_id = str(flow_run.get_id())
    datasets = image_datasets(data, source)
    origin = run_origin()
    what = describe(params, specs, f"{params.arch} image classifier ({len(data.classes)} classes)")
    run_name, identity_tags = run_identity(origin, f"sweep-{flow_run_id}", what, datasets)
    shared = {
        "source": redact_url(source),
        "weights": redact_url(params.weights),
        "num_classes": len(data.classes),
        "data_fingerprint": data.fingerprint,
    }
    parent = start_run(
        settings.tracking_uri,
        params.experiment,
        run_name=run_name,
        params={**parent_params(params, specs), **shared},
        tags={"prefect.flow_run_id": flow_run_id, "ddpflow.workload": WORKLOAD, **identity_tags},
        artifact_location=artifact_location,
    )
    log_datasets(parent, datasets)
    return SweepSetup(
        corpus=None,
        parent=parent,
        experiment=params.experiment,
        artifact_root=settings.artifact_root,
        artifact_location=artifact_location,
        keep_last=params.keep_last,
        rank_resources=settings.rank_resources,
        params={**shared, "world_size": params.ranks_per_trial},
        tags={
            "prefect.flow_run_id": flow_run_id,
            "ddpflow.workload": "images-trial",
            **origin.tags(),
        },
        datasets=datasets,
        fields=IMAGE_FIELDS,
        job=partial(_trial_job, params, data, weights_uri),
    )


def _trial_job(
    params: ImageSweepParams,
    data: FormattedImages,
    weights_uri: str | None,
    config: ImageTrialConfig,
    setup: SweepSetup,
    run: RunRef,
) -> ImageTrainJob:
    """One trial's image training: the trial's fields, the sweep's model, data and weights."""
    model = ImageModelConfig(
        params.arch,
        len(data.classes),
        params.image_size,
        tuple(data.classes),
        config.freeze_backbone,
    )
    return ImageTrainJob(
        train_uri=data.train_uri,
        val_uri=data.val_uri,
        model=model,
        weights_uri=weights_uri,
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        optimizer=params.optimizer,
        lr_patience=params.lr_patience,
        seed=config.seed,
        # Under the trial's own run id, like train-images: trials never share a folder.
        checkpoint_root=storage.join(setup.artifact_root, "runs", run.run_id, "checkpoints"),
        keep_last=setup.keep_last,
        run=run,
        # As sweep-charlm's trials: fp32, unpinned, uncompiled; the memory format as asked.
        speed=replace(PLAIN, channels_last=params.channels_last),
        augment=config.augment,
    )


def _compare_and_register(
    outcomes: list[TrialOutcome], parent: RunRef, params: ImageSweepParams
) -> SweepSummary:
    rows = search_rows(outcomes) if params.search is not None else table_rows(outcomes)
    log_to_parent(parent, outcomes, plots(outcomes))
    publish_table(
        rows,
        TABLE_KEY,
        f"image sweep, trials ranked by validation loss (MLflow {parent.run_id})",
    )
    top = best(outcomes)
    version = None
    if top is not None and top.checkpoint_uri is not None:
        best_run = RunRef(parent.tracking_uri, top.run_id)
        version = register_trained("images", best_run, top.checkpoint_uri, params.model_name)
    return SweepSummary(
        parent_run_id=parent.run_id,
        rows=rows,
        num_completed=sum(o.completed for o in outcomes),
        best_run_id=top.run_id if top else None,
        best_val_loss=top.final_val_loss if top else None,
        model_name=params.model_name,
        model_version=version,
        promotion=None,
        promoted=False,
        table_key=TABLE_KEY,
        columns=IMAGE_COLUMNS,
    )


if __name__ == "__main__":
    run_cli(sweep_images)
