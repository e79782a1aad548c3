"""How the pet-name training scales: the same training at world sizes 1, 2, ... N.

One MLflow parent run with a child run per size (each recorded like a train-charlm run), a
table of steady samples/s, efficiency against linear and time to `target_loss`, plots,
and the table as the Prefect artifact `charlm-scaling`. Nothing is evaluated or registered.

Run it: `python -m flows.scaling_charlm --epochs 3 --world-sizes 1,2 --target-loss 2.2`
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
from ddpflow.workloads.charlm.job import CharLMTrainJob
from ddpflow.workloads.scaling import Target
from flows.charlm_pipeline import (
    charlm_job,
    corpus_datasets,
    prepare_corpus,
    start_charlm_run,
)
from flows.cli import run_cli
from flows.params import CharLMParams, CharLMScalingParams
from flows.scaling import (
    NOT_REGISTERED,
    ScalingSummary,
    begin,
    child_tags,
    measure,
    size_trainer,
    start_parent,
)
from tasks.charlm import TRAINING

WORKLOAD = "charlm-scaling"
TABLE_KEY = "charlm-scaling"


@flow(name="scaling-charlm", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def scaling_charlm(
    scaling: CharLMScalingParams = CharLMScalingParams(),  # noqa: B008 - frozen
) -> ScalingSummary:
    """Train the pet-name LSTM at each world size in turn and compare the throughput."""
    # Each size trains as train-charlm would, with nothing to generate or register.
    params = CharLMParams(
        **scaling.model_dump(exclude={"world_sizes", "target_loss"}),
        num_names=0,
        model_name=NOT_REGISTERED,
    )
    settings = Settings.from_env()
    sizes = begin(settings, WORKLOAD, scaling.world_sizes)
    raw, corpus = prepare_corpus(params, settings)
    datasets = corpus_datasets(corpus, params.source)
    parent = start_parent(
        settings,
        params.experiment,
        WORKLOAD,
        "Pet-name training (charlm)",
        sizes,
        datasets,
        {
            **params.model_dump(
                exclude={"world_size", "min_workers", "max_workers", "num_names", "model_name"}
            ),
            "source": redact_url(params.source),
            "target_loss": scaling.target_loss,
            "data_sha256": raw.sha256,
        },
    )

    def start_child(size: int) -> RunRef:
        return start_charlm_run(
            params, settings, raw.sha256, corpus, datasets, size, child_tags(size), parent
        )

    def job_for(run: RunRef, checkpoints: str) -> CharLMTrainJob:
        return charlm_job(params, corpus, run, checkpoints)

    train = size_trainer(settings, TRAINING, job_for, params.rank_timeout_s, params.max_restarts)
    target = Target("val_loss", scaling.target_loss)
    return measure(settings, parent, sizes, start_child, train, target, "charlm", TABLE_KEY)


if __name__ == "__main__":
    run_cli(scaling_charlm)
