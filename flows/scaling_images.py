"""How the image training scales: the same fine-tuning at world sizes 1, 2, ... N.

One MLflow parent run with a child run per size (each recorded like a train-images run), a
table of steady samples/s, efficiency against linear and time to `target_accuracy`, plots,
and the table as the Prefect artifact `images-scaling`. Nothing is evaluated or registered.

Run it: `python -m flows.scaling_images --epochs 3 --world-sizes 1,2 --target-accuracy 0.9`
"""

from __future__ import annotations

if __name__ == "__main__":
    # A command line: the embedded API and the cluster start while the imports below load.
    from ddpflow.integrations.prefect.early_api import start_services

    start_services()

from prefect import flow

from ddpflow.config import Settings
from ddpflow.integrations.prefect.task_runner import dask_task_runner
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.scaling import Target
from ddpflow.workloads.vision.job import ImageTrainJob
from flows.cli import run_cli
from flows.params import ImageParams, ImageScalingParams
from flows.scaling import (
    NOT_REGISTERED,
    ScalingSummary,
    begin,
    child_tags,
    measure,
    size_trainer,
    start_parent,
)
from flows.train_images import image_datasets, image_job, prepare_images, start_images_run
from tasks.images import TRAINING

WORKLOAD = "images-scaling"
TABLE_KEY = "images-scaling"


@flow(name="scaling-images", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def scaling_images(
    scaling: ImageScalingParams = ImageScalingParams(),  # noqa: B008 - frozen
) -> ScalingSummary:
    """Fine-tune the ResNet at each world size in turn and compare the throughput."""
    # Each size trains as train-images would, with nothing to register.
    params = ImageParams(
        **scaling.model_dump(exclude={"world_sizes", "target_accuracy"}),
        model_name=NOT_REGISTERED,
    )
    settings = Settings.from_env()
    sizes = begin(settings, WORKLOAD, scaling.world_sizes)
    source, data, weights_uri = prepare_images(params, settings)
    parent = start_parent(
        settings,
        params.experiment,
        WORKLOAD,
        f"Image classifier ({params.arch})",
        sizes,
        image_datasets(data, source),
        {
            **params.model_dump(exclude={"world_size", "min_workers", "max_workers", "model_name"}),
            "source": redact_url(source),
            "weights": redact_url(params.weights),
            "target_accuracy": scaling.target_accuracy,
            "data_fingerprint": data.fingerprint,
        },
    )

    def start_child(size: int) -> RunRef:
        return start_images_run(params, settings, source, data, size, parent, child_tags(size))

    def job_for(run: RunRef, checkpoints: str) -> ImageTrainJob:
        return image_job(params, data, weights_uri, run, checkpoints)

    train = size_trainer(settings, TRAINING, job_for, params.rank_timeout_s, params.max_restarts)
    target = Target("val_accuracy", scaling.target_accuracy, higher_is_better=True)
    return measure(settings, parent, sizes, start_child, train, target, "images", TABLE_KEY)


if __name__ == "__main__":
    run_cli(scaling_images)
