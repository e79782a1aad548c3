"""Prefect tasks for the pet-name workload: each calls ddpflow and returns URIs and numbers."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from ddpflow.charlm.data import FormattedCorpus, SourceCopy, fetch_corpus, format_corpus
from ddpflow.charlm.evaluation import (
    EvalResult,
    evaluate_checkpoint,
    evaluation_markdown,
    log_evaluation,
    save_report,
)
from ddpflow.charlm.training import CharLMTrainJob, train_rank
from ddpflow.config import LaunchSettings
from ddpflow.tracking import RunRef
from ddpflow.train_loop import TrainResult
from ddpflow_tasks.restarts import train_with_restarts

# The Prefect artifact listing logging calls the MLflow run lacks (ddpflow_tasks.tracking_report).
INCOMPLETE_KEY = "charlm-tracking-incomplete"


@task(name="download-corpus")
def download_corpus(source: str, artifact_root: str) -> SourceCopy:
    """Copy the name list into the artifact store under its content hash."""
    return fetch_corpus(source, artifact_root)


@task(name="format-corpus")
def format_training_data(
    raw_uri: str, artifact_root: str, holdout_fraction: float
) -> FormattedCorpus:
    """Clean, split and format the names into compact index tensors."""
    return format_corpus(raw_uri, artifact_root, holdout_fraction)


@task(name="train-ddp")
def train_ddp(
    job: CharLMTrainJob,
    world_size: int | None,
    rank_timeout_s: float,
    max_restarts: int = 2,
    min_workers: int | None = None,
    *,
    launch: LaunchSettings,
) -> TrainResult:
    """Run one DDP group, healed and resumed from its checkpoint after a failure.

    Call it directly from the flow (not .submit) so the launcher runs in the flow process.
    """
    return train_with_restarts(
        train_rank,
        job,
        job.run,
        "charlm-restarts",
        world_size,
        rank_timeout_s,
        max_restarts,
        min_workers,
        progress_key="charlm-progress",
        incomplete_key=INCOMPLETE_KEY,
        launch=launch,
    )


@task(name="evaluate")
def evaluate(
    run: RunRef,
    checkpoint_uri: str,
    corpus: FormattedCorpus,
    num_names: int,
    seed: int,
    report_dir: str,
) -> EvalResult:
    """Holdout loss and generated names: to MLflow, the artifact store and a Prefect artifact."""
    result = evaluate_checkpoint(
        checkpoint_uri, corpus.val_uri, corpus.train_names_uri, num_names, seed
    )
    markdown = evaluation_markdown(run, result, corpus)
    log_evaluation(run, result)
    save_report(report_dir, result, markdown)
    create_markdown_artifact(
        markdown=markdown,
        key="charlm-evaluation",
        description="pet-name model evaluation",
    )
    return result
