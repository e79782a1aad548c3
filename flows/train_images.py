"""Image classification by transfer learning, with DDP: format -> train -> evaluate -> register.

Run it: `python -m flows.train_images` (the digits demo folder) or with `--source
s3://bucket/images` for any `<root>/<class>/<image>` folder.
"""

from __future__ import annotations

if __name__ == "__main__":
    # A command line: the embedded API and the cluster start while the imports below load.
    from ddpflow.integrations.prefect.early_api import start_services

    start_services()

from dataclasses import dataclass

from mlflow.tracking import MlflowClient
from prefect import flow, unmapped

from ddpflow import storage
from ddpflow.config import LaunchSettings, Settings
from ddpflow.integrations.prefect.task_runner import dask_task_runner
from ddpflow.shards.encoding import ShardEncoding
from ddpflow.shards.index import is_index_uri
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import DatasetRef
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import end_run, failed_on_error, world_sizes_text
from ddpflow.tracking.spool import Unsent
from ddpflow.training.speed.settings import SpeedSettings
from ddpflow.workloads.registration import Workload
from ddpflow.workloads.vision.config import ImageModelConfig
from ddpflow.workloads.vision.data import FormattedImages, ImageSpec
from ddpflow.workloads.vision.job import ImageTrainJob
from flows.cli import run_cli
from flows.inspection import publish_mlflow_links, tag_flow_run
from flows.params import ImageParams
from flows.preflight import run_preflight
from flows.summary import kept_line, mlflow_ui_hint, print_last
from flows.workload_run import start_workload_run
from tasks.images import (
    INCOMPLETE_KEY,
    TRAINING,
    evaluate,
    format_image_chunk,
    format_images,
    index_image_shards,
    plan_image_shards,
    prepare_digits,
    prepare_weights,
    reuse_image_shards,
)
from tasks.inspection import describe_datasets
from tasks.registration import register_trained
from tasks.restarts import train_ddp
from tasks.tracking_report import tracking_line

WORKLOAD: Workload = "images"
# On a registered version whose accuracy is no result (no better than the majority class,
# or one class for every image): the reasons.
NO_RESULT_TAG = "ddpflow.no_better_than_baseline"


@dataclass(frozen=True)
class ImageSummary:
    run_id: str
    val_accuracy: float
    val_loss: float
    num_val: int
    num_skipped: int
    checkpoint_uri: str
    checkpoint_dir: str
    report_dir: str
    model_version: str
    world_size: int  # the size the training ended at
    # Logging calls MLflow never took (ddpflow.tracking.spool); the run is tagged with them.
    unsent: tuple[Unsent, ...] = ()
    # (checkpoints, bytes) the store keeps once training is done; MLflow keeps the same.
    kept: tuple[int, int] = (0, 0)
    # Every size the group trained at, in order, the last `world_size` (a grow: (2, 3)).
    world_sizes: tuple[int, ...] = ()
    # The MLflow run's experiment: the summary's link opens the run in the training view.
    experiment_id: str | None = None
    # Always answering the validation set's most common class scores this.
    baseline_accuracy: float = float("nan")
    # What makes the accuracy no result (ImageEvalResult.warnings); empty when nothing does.
    warnings: tuple[str, ...] = ()

    def render(self, settings: Settings) -> str:
        return "\n".join(
            [
                "",
                "ddpflow: image classifier trained",
                f"  MLflow run id      {self.run_id}",
                f"  world size         {world_sizes_text(self.world_sizes or (self.world_size,))}",
                f"  val accuracy       {self.val_accuracy:.2%} of {self.num_val} images "
                f"(majority-class baseline {self.baseline_accuracy:.2%})",
                *(f"  WARNING            {warning}" for warning in self.warnings),
                f"  val loss           {self.val_loss:.4f}",
                f"  skipped files      {self.num_skipped} unreadable",
                f"  checkpoints        {redact_url(self.checkpoint_dir)} ({kept_line(*self.kept)})",
                f"  latest checkpoint  {redact_url(self.checkpoint_uri)}",
                f"  reports            {self.report_dir} (confusion matrix CSV/PNG)",
                f"  registered model   version {self.model_version} (the latest checkpoint's"
                + (", tagged ddpflow.no_better_than_baseline)" if self.warnings else ")"),
                f"  tracking           {tracking_line(self.unsent, INCOMPLETE_KEY)}",
                f"  MLflow UI          "
                f"{mlflow_ui_hint(settings.tracking_uri, self.run_id, self.experiment_id)}",
                "",
            ]
        )


@flow(name="train-images", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def train_images(training: ImageParams = ImageParams()) -> ImageSummary:  # noqa: B008 - frozen
    """Fine-tune a torchvision ResNet on an image folder with one DDP rank per Dask worker."""
    settings = Settings.from_env()
    tag_flow_run(WORKLOAD)
    # Pre-flight: an unusable store, tracking server or cluster fails before any work.
    ranks = run_preflight(settings, training.world_size)

    source, data, weights_uri = prepare_images(training, settings)
    run = start_images_run(training, settings, source, data, len(ranks))
    # Everything a run writes lives under its own folder: concurrent runs never collide.
    run_dir = storage.join(settings.artifact_root, "runs", run.run_id)
    with failed_on_error(run):
        summary = _train_evaluate_register(
            training, data, weights_uri, run, run_dir, len(ranks), settings.launch
        )
    end_run(run, unsent=summary.unsent)
    publish_mlflow_links(run, "images-mlflow", training.model_name, summary.model_version)
    print_last(summary.render(settings))
    return summary


def prepare_images(
    params: ImageParams, settings: Settings
) -> tuple[str, FormattedImages, str | None]:
    """The image folder (default the digits demo), its formatted splits and the weights."""
    source = params.source
    if source is None:
        digits = prepare_digits.submit(storage.join(settings.artifact_root, "data", "digits"))
        source = digits.result().uri
    spec = ImageSpec(params.image_size, params.resize)
    data = _format_as_shards(params, settings, source, spec)
    if data is None:
        data = format_images.submit(
            source,
            settings.artifact_root,
            spec,
            params.val_fraction,
            params.seed,
            params.max_bad_fraction,
            params.max_image_mb,
        ).result()
    layout = "streamed from shards" if is_index_uri(data.train_uri) else "held in memory"
    print(
        f"images: {len(data.classes)} classes, {data.num_train} train / {data.num_val} "
        f"validation, {len(data.bad)} unreadable file(s) skipped, {layout}"
        + (" (formatted data reused)" if data.reused else "")
    )
    weights_uri = prepare_weights.submit(
        params.arch, params.weights, settings.artifact_root
    ).result()
    return source, data, weights_uri


def _format_as_shards(
    params: ImageParams, settings: Settings, source: str, spec: ImageSpec
) -> FormattedImages | None:
    """With data_layout shards (or auto over stream_above_mb formatted), the folder formatted
    into shards by one task per chunk on the cluster's workers; None: hold it in memory."""
    if params.data_layout == "memory":
        return None
    plan = plan_image_shards.submit(
        source,
        settings.artifact_root,
        spec,
        params.val_fraction,
        params.seed,
        params.max_image_mb,
        params.shard_mb,
        ShardEncoding(params.shard_encoding, params.jpeg_quality),
    ).result()
    if params.data_layout == "auto" and plan.formatted_mb <= params.stream_above_mb:
        return None
    stored = reuse_image_shards.submit(plan).result()
    if stored is not None:
        return stored
    print(f"images: formatting {len(plan.chunks)} chunk(s) into shards on the cluster")
    # One task run per chunk: the Prefect UI counts them as they finish.
    results = format_image_chunk.map(unmapped(plan.target), plan.chunks)
    # Prefect resolves the futures to their results before the task runs.
    return index_image_shards.submit(plan, results, params.max_bad_fraction).result()  # type: ignore[arg-type]


def start_images_run(
    params: ImageParams,
    settings: Settings,
    source: str,
    data: FormattedImages,
    world: int,
    parent: RunRef | None = None,
    tags: dict[str, str] | None = None,
) -> RunRef:
    """The image training's MLflow run (see start_workload_run): its parameters name the
    folder, weights and splits. With `parent`, a scaling run's child for `world`."""
    datasets = image_datasets(data, source)
    return start_workload_run(
        settings,
        params.experiment,
        WORKLOAD,
        f"An image classifier ({params.arch}, {len(data.classes)} classes)",
        datasets,
        {
            **params.model_dump(),
            "source": redact_url(source),
            "weights": redact_url(params.weights),
            "world_size": world,
            "effective_lr": params.lr * world,
            "num_classes": len(data.classes),
            "num_train": data.num_train,
            "num_val": data.num_val,
            "num_skipped_files": len(data.bad),
            "data_fingerprint": data.fingerprint,
        },
        tags,
        parent,
        world,
    )


def image_datasets(data: FormattedImages, source: str) -> list[DatasetRef]:
    """The formatted train and validation splits the ranks read, with content digests."""
    classes = len(data.classes)
    inputs = [
        (
            "images-train",
            data.train_uri,
            "training",
            {"images": data.num_train, "classes": classes},
        ),
        (
            "images-validation",
            data.val_uri,
            "validation",
            {"images": data.num_val, "classes": classes},
        ),
    ]
    return describe_datasets.submit(inputs, redact_url(source)).result()


def image_job(
    params: ImageParams,
    data: FormattedImages,
    weights_uri: str | None,
    run: RunRef,
    checkpoint_dir: str,
) -> ImageTrainJob:
    """What every rank of the training gets: data, model, optimisation, run, checkpoints."""
    model = ImageModelConfig(
        params.arch,
        len(data.classes),
        params.image_size,
        tuple(data.classes),
        params.freeze_backbone,
    )
    return ImageTrainJob(
        train_uri=data.train_uri,
        val_uri=data.val_uri,
        model=model,
        weights_uri=weights_uri,
        epochs=params.epochs,
        batch_size=params.batch_size,
        lr=params.lr,
        optimizer=params.optimizer,
        lr_patience=params.lr_patience,
        seed=params.seed,
        checkpoint_root=checkpoint_dir,
        keep_last=params.keep_last,
        run=run,
        speed=SpeedSettings(
            params.precision, params.channels_last, params.pin_memory, params.compile
        ),
        checkpoint_every_steps=params.checkpoint_every_steps,
        checkpoint_every_s=params.checkpoint_every_s,
        global_batch=params.global_batch,
        # "auto": on for a folder of the user's; the digits demo's 8 x 8 digits are not
        # mirror-symmetric and lose their strokes to small crops (50 % after 2 epochs on,
        # 91 % off, measured on 2 CPUs).
        augment=params.augment is True or (params.augment == "auto" and params.source is not None),
    )


def _train_evaluate_register(
    params: ImageParams,
    data: FormattedImages,
    weights_uri: str | None,
    run: RunRef,
    run_dir: str,
    world_size: int,
    launch: LaunchSettings,
) -> ImageSummary:
    checkpoint_dir = storage.join(run_dir, "checkpoints")
    report_dir = storage.join(run_dir, "reports")
    job = image_job(params, data, weights_uri, run, checkpoint_dir)
    trained = train_ddp(
        TRAINING,
        job,
        world_size,
        params.rank_timeout_s,
        params.max_restarts,
        params.min_workers,
        params.max_workers,
        launch=launch,
    )
    checkpoint = trained.latest_checkpoint
    assert checkpoint is not None  # rank 0 checkpoints at each epoch's end (epochs >= 1)
    evaluation = evaluate.submit(run, checkpoint, data, report_dir).result()
    version = register_trained(WORKLOAD, run, checkpoint, params.model_name)
    if evaluation.warnings():
        # Registered all the same (a run's model is always findable), but marked, so that
        # whoever picks a version sees it is no result.
        MlflowClient(run.tracking_uri).set_model_version_tag(
            params.model_name, version, NO_RESULT_TAG, "; ".join(evaluation.warnings())
        )
    return ImageSummary(
        run_id=run.run_id,
        experiment_id=run.experiment_id,
        val_accuracy=evaluation.val_accuracy,
        val_loss=evaluation.val_loss,
        num_val=evaluation.num_val,
        num_skipped=len(data.bad),
        checkpoint_uri=checkpoint,
        checkpoint_dir=checkpoint_dir,
        report_dir=report_dir,
        model_version=version,
        world_size=trained.world_sizes[-1] if trained.world_sizes else world_size,
        world_sizes=trained.world_sizes,
        unsent=trained.unsent,
        kept=storage.folder_usage(checkpoint_dir, ".pt"),
        baseline_accuracy=evaluation.baseline_accuracy,
        warnings=tuple(evaluation.warnings()),
    )


if __name__ == "__main__":
    run_cli(train_images)
