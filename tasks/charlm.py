"""Prefect tasks for the pet-name workload: each calls ddpflow and returns URIs and numbers."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.charlm.data import FormattedCorpus, SourceCopy, fetch_corpus, format_corpus
from ddpflow.workloads.charlm.report import EvalResult, evaluation_markdown, save_report
from ddpflow.workloads.charlm.shard_format import (
    CorpusShardPlan,
    NameChunk,
    NameShard,
    format_name_chunk,
    index_corpus_shards,
    plan_corpus_shards,
    reusable_corpus,
    write_train_names,
)
from tasks.restarts import DDPWorkload, RankFunction

# The Prefect artifact listing logging calls the MLflow run lacks (tasks.tracking_report).
INCOMPLETE_KEY = "charlm-tracking-incomplete"
# The pet-name training, for tasks.restarts.train_ddp (the `train-ddp` task).
TRAINING = DDPWorkload(
    RankFunction("ddpflow.workloads.charlm.training:train_rank"),
    "charlm-restarts",
    "charlm-progress",
    INCOMPLETE_KEY,
)


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


@task(name="plan-corpus-shards")
def plan_corpus(
    raw_uri: str, artifact_root: str, holdout_fraction: float, shard_mb: float
) -> CorpusShardPlan:
    """Parse, split and chunk the names, one shard a chunk (charlm.shard_format)."""
    return plan_corpus_shards(raw_uri, artifact_root, holdout_fraction, shard_mb)


@task(name="reuse-corpus-shards")
def reuse_corpus(plan: CorpusShardPlan) -> FormattedCorpus | None:
    """The stored shards of this format, when every one is still there."""
    return reusable_corpus(plan)


@task(name="write-train-names")
def save_train_names(uri: str, names: list[str]) -> None:
    """Keep the training names for the evaluation's novelty check."""
    write_train_names(uri, names)


@task(name="format-name-chunk")
def format_chunk(store: str, chunk: NameChunk) -> NameShard:
    """Format one chunk of names on a worker and write it as one shard."""
    return format_name_chunk(store, chunk)


@task(name="index-corpus-shards")
def index_corpus(plan: CorpusShardPlan, results: list[NameShard]) -> FormattedCorpus:
    """Write both splits' indexes and the manifest."""
    return index_corpus_shards(plan, results)


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
    # Imported when the task runs: evaluation needs torch, and the flow process that imports
    # this module starts without it.
    from ddpflow.workloads.charlm.evaluation import evaluate_checkpoint, log_evaluation

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
