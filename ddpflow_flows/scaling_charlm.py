"""How the pet-name training scales: the same training at world sizes 1, 2, ... N.

One MLflow parent run with a child run per size (each recorded like a train-charlm run), a
table of steady samples/s, efficiency against linear and time to `target_loss`, plots,
and the table as the Prefect artifact `charlm-scaling`. Nothing is evaluated or registered.

Run it: `python -m ddpflow_flows.scaling_charlm --epochs 3 --world-sizes 1,2 --target-loss 2.2`
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpflow import storage
from ddpflow.config import Settings
from ddpflow.redact import redact_url
from ddpflow.scaling import Target
from ddpflow.tracking import RunRef, failed_on_error
from ddpflow.train_loop import EpochStats
from ddpflow_flows.charlm_pipeline import (
    charlm_job,
    corpus_datasets,
    prepare_corpus,
    start_charlm_run,
)
from ddpflow_flows.cli import run_cli
from ddpflow_flows.defaults import SCALING_CHARLM
from ddpflow_flows.inspection import tag_flow_run
from ddpflow_flows.param_flow import FlowParameters, flow
from ddpflow_flows.params import CharLMParams, ScalingParams
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
from ddpflow_tasks.charlm import train_ddp

WORKLOAD = "charlm-scaling"
TABLE_KEY = "charlm-scaling"


# What a scaling run sets itself, for the training's own parameter checks.
PARAMETERS = FlowParameters(
    SCALING_CHARLM,
    (ScalingParams, CharLMParams),
    fixed={"world_size": None, "num_names": 0, "model_name": NOT_REGISTERED},
)


@flow(PARAMETERS, name="scaling-charlm", task_runner=dask_task_runner(), log_prints=True)
def scaling_charlm(checked: tuple[ScalingParams, CharLMParams]) -> ScalingSummary:
    """Train the pet-name LSTM at each world size in turn and compare the throughput."""
    scaling, params = checked
    settings = Settings.from_env()
    tag_flow_run(WORKLOAD)
    sizes = plan_sizes(scaling.world_sizes)  # bad sizes fail before any download
    run_preflight(settings, max(sizes))
    raw, corpus = prepare_corpus(params, settings)
    datasets = corpus_datasets(corpus, params.source)
    parent = start_parent(
        settings,
        params.experiment,
        WORKLOAD,
        f"Pet-name training (charlm) at world sizes {', '.join(map(str, sizes))}",
        datasets,
        {
            **params.model_dump(exclude={"world_size", "min_workers", "num_names", "model_name"}),
            "source": redact_url(params.source),
            "world_sizes": ",".join(map(str, sizes)),
            "target_loss": scaling.target_loss,
            "data_sha256": raw.sha256,
        },
    )

    def start_child(size: int) -> RunRef:
        return start_charlm_run(
            params, settings, raw.sha256, corpus, datasets, size, child_tags(size), parent
        )

    def train(size: int, run: RunRef) -> Sequence[EpochStats]:
        checkpoints = storage.join(settings.artifact_root, "runs", run.run_id, "checkpoints")
        job = charlm_job(params, corpus, run, checkpoints)
        # A restart relaunches at the same size (min_workers defaults to the world size).
        return train_ddp(
            job, size, params.rank_timeout_s, params.max_restarts, launch=settings.launch
        ).history

    with failed_on_error(parent):
        results = run_sizes(sizes, start_child, train)
        summary = report(
            parent, results, Target("val_loss", scaling.target_loss), "charlm", TABLE_KEY
        )
    return finish(parent, summary, mlflow_ui_hint(settings.tracking_uri, parent.run_id))


if __name__ == "__main__":
    run_cli(scaling_charlm)
