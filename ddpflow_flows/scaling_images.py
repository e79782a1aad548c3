"""How the image training scales: the same fine-tuning at world sizes 1, 2, ... N.

One MLflow parent run with a child run per size (each recorded like a train-images run), a
table of steady samples/s, efficiency against linear and time to `target_accuracy`, plots,
and the table as the Prefect artifact `images-scaling`. Nothing is evaluated or registered.

Run it: `python -m ddpflow_flows.scaling_images --epochs 3 --world-sizes 1,2 --target-accuracy 0.9`
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpflow import storage
from ddpflow.config import Settings
from ddpflow.redact import redact_url
from ddpflow.scaling import Target
from ddpflow.tracking import RunRef, failed_on_error
from ddpflow.train_loop import EpochStats
from ddpflow_flows.cli import run_cli
from ddpflow_flows.defaults import SCALING_IMAGES
from ddpflow_flows.inspection import tag_flow_run
from ddpflow_flows.param_flow import FlowParameters, flow
from ddpflow_flows.params import ImageParams, ScalingParams
from ddpflow_flows.preflight import run_preflight
from ddpflow_flows.runner import dask_task_runner
from ddpflow_flows.scaling import (
    NOT_REGISTERED,
    ScalingSummary,
    child_tags,
    finish,
    plan_sizes,
    report,
    run_sizes,
    start_parent,
)
from ddpflow_flows.summary import mlflow_ui_hint
from ddpflow_flows.train_images import image_datasets, image_job, prepare_images, start_images_run
from ddpflow_tasks.images import train_ddp

WORKLOAD = "images-scaling"
TABLE_KEY = "images-scaling"


# What a scaling run sets itself, for the training's own parameter checks.
PARAMETERS = FlowParameters(
    SCALING_IMAGES,
    (ScalingParams, ImageParams),
    fixed={"world_size": None, "model_name": NOT_REGISTERED},
)


@flow(PARAMETERS, name="scaling-images", task_runner=dask_task_runner(), log_prints=True)
def scaling_images(checked: tuple[ScalingParams, ImageParams]) -> ScalingSummary:
    """Fine-tune the ResNet at each world size in turn and compare the throughput."""
    scaling, params = checked
    settings = Settings.from_env()
    tag_flow_run(WORKLOAD)
    sizes = plan_sizes(scaling.world_sizes)  # bad sizes fail before any data is read
    run_preflight(settings, max(sizes))
    source, data, weights_uri = prepare_images(params, settings)
    parent = start_parent(
        settings,
        params.experiment,
        WORKLOAD,
        f"Image classifier ({params.arch}) at world sizes {', '.join(map(str, sizes))}",
        image_datasets(data, source),
        {
            **params.model_dump(exclude={"world_size", "model_name"}),
            "source": redact_url(source),
            "weights": redact_url(params.weights),
            "world_sizes": ",".join(map(str, sizes)),
            "target_accuracy": scaling.target_accuracy,
            "data_fingerprint": data.fingerprint,
        },
    )

    def start_child(size: int) -> RunRef:
        return start_images_run(params, settings, source, data, size, parent, child_tags(size))

    def train(size: int, run: RunRef) -> Sequence[EpochStats]:
        checkpoints = storage.join(settings.artifact_root, "runs", run.run_id, "checkpoints")
        job = image_job(params, data, weights_uri, run, checkpoints)
        return train_ddp(
            job, size, params.rank_timeout_s, params.max_restarts, launch=settings.launch
        ).history

    target = Target("val_accuracy", scaling.target_accuracy, higher_is_better=True)
    with failed_on_error(parent):
        results = run_sizes(sizes, start_child, train)
        summary = report(parent, results, target, "images", TABLE_KEY)
    return finish(parent, summary, mlflow_ui_hint(settings.tracking_uri, parent.run_id))


if __name__ == "__main__":
    run_cli(scaling_images)
