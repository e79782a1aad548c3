"""The pet-name pipeline shared by the train and retrain flows.

download -> format -> train (DDP) -> evaluate -> register, inside the calling flow (its task
runner and its flow run), with pre-flight first and exactly one MLflow run. The scaling flow
reuses its steps (prepare_corpus, start_charlm_run, charlm_job) for each world size's run.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import unmapped

from ddpflow import storage
from ddpflow.config import LaunchSettings, Settings
from ddpflow.shards.index import is_index_uri
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import DatasetRef
from ddpflow.tracking.loggers import RunRef
from ddpflow.tracking.run import end_run, failed_on_error, world_sizes_text
from ddpflow.tracking.spool import Unsent
from ddpflow.training.speed.settings import SpeedSettings
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.data import FormattedCorpus, SourceCopy
from ddpflow.workloads.charlm.job import CharLMTrainJob
from ddpflow.workloads.registration import Workload
from flows.inspection import publish_mlflow_links, tag_flow_run
from flows.params import CharLMParams
from flows.preflight import run_preflight
from flows.summary import kept_line, mlflow_ui_hint
from flows.workload_run import start_workload_run
from tasks.charlm import (
    INCOMPLETE_KEY,
    TRAINING,
    download_corpus,
    evaluate,
    format_chunk,
    format_training_data,
    index_corpus,
    plan_corpus,
    reuse_corpus,
    save_train_names,
)
from tasks.inspection import describe_datasets
from tasks.registration import register_trained
from tasks.restarts import train_ddp
from tasks.tracking_report import tracking_line

WORKLOAD: Workload = "charlm"


@dataclass(frozen=True)
class CharLMSummary:
    run_id: str
    final_val_loss: float
    names: list[str]
    novel_fraction: float
    checkpoint_uri: str
    checkpoint_dir: str
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

    def render(self, settings: Settings) -> str:
        return "\n".join(
            [
                "",
                "ddpflow: pet-name model trained",
                f"  MLflow run id      {self.run_id}",
                f"  world size         {world_sizes_text(self.world_sizes or (self.world_size,))}",
                f"  final val loss     {self.final_val_loss:.4f}",
                f"  generated names    {', '.join(n or '(empty)' for n in self.names)}",
                f"  novel names        {self.novel_fraction:.0%} not in the training set",
                f"  checkpoints        {redact_url(self.checkpoint_dir)} ({kept_line(*self.kept)})",
                f"  latest checkpoint  {redact_url(self.checkpoint_uri)}",
                f"  registered model   version {self.model_version}",
                f"  tracking           {tracking_line(self.unsent, INCOMPLETE_KEY)}",
                f"  MLflow UI          "
                f"{mlflow_ui_hint(settings.tracking_uri, self.run_id, self.experiment_id)}",
                "",
            ]
        )


def run_charlm_pipeline(
    params: CharLMParams, settings: Settings, tags: dict[str, str] | None = None
) -> tuple[CharLMSummary, RunRef, FormattedCorpus]:
    """Run every step; the MLflow run is FINISHED on success and FAILED on any error."""
    tag_flow_run(WORKLOAD)
    # Pre-flight: an unusable store, tracking server or cluster fails before any work.
    ranks = run_preflight(settings, params.world_size)
    raw, corpus = prepare_corpus(params, settings)
    datasets = corpus_datasets(corpus, params.source)
    run = start_charlm_run(params, settings, raw.sha256, corpus, datasets, len(ranks), tags)
    # Everything a run writes lives under its own folder: concurrent runs never collide.
    run_dir = storage.join(settings.artifact_root, "runs", run.run_id)
    with failed_on_error(run):
        summary = _train_evaluate_register(
            params, corpus, run, run_dir, len(ranks), settings.launch
        )
    end_run(run, unsent=summary.unsent)
    publish_mlflow_links(run, "charlm-mlflow", params.model_name, summary.model_version)
    return summary, run, corpus


def prepare_corpus(params: CharLMParams, settings: Settings) -> tuple[SourceCopy, FormattedCorpus]:
    """Download the names and format them into tensors (each step reused when unchanged)."""
    raw = download_corpus.submit(params.source, settings.artifact_root).result()
    corpus = _format_as_shards(params, settings, raw)
    if corpus is None:
        corpus = format_training_data.submit(
            raw.uri, settings.artifact_root, params.holdout_fraction
        ).result()
    # Say so when a rerun skipped the work, as the image flow does.
    reused = [what for what, hit in (("raw copy", raw.reused), ("tensors", corpus.reused)) if hit]
    layout = "streamed from shards" if is_index_uri(corpus.train_uri) else "held in memory"
    print(
        f"corpus: {corpus.num_train_names} train / {corpus.num_val_names} holdout names, "
        f"{corpus.num_train_samples} samples, {layout}; cleaning: {corpus.clean_report}"
        + (f" ({' and '.join(reused)} reused)" if reused else "")
    )
    return raw, corpus


def _format_as_shards(
    params: CharLMParams, settings: Settings, raw: SourceCopy
) -> FormattedCorpus | None:
    """With data_layout shards (or auto over stream_above_mb formatted), the corpus
    formatted into shards by one task per chunk of names on the cluster's workers; None:
    hold it in memory (docs/data.md)."""
    if params.data_layout == "memory":
        return None
    plan = plan_corpus.submit(
        raw.uri, settings.artifact_root, params.holdout_fraction, params.shard_mb
    ).result()
    if params.data_layout == "auto" and plan.formatted_mb <= params.stream_above_mb:
        return None
    stored = reuse_corpus.submit(plan.without_chunks()).result()
    if stored is not None:
        return stored
    print(f"corpus: formatting {len(plan.chunks)} chunk(s) of names into shards on the cluster")
    names = save_train_names.submit(plan.train_names_uri, plan.train_names())
    # One task run per chunk: the Prefect UI counts them as they finish.
    results = format_chunk.map(unmapped(plan.store), plan.chunks)
    names.result()
    # Prefect resolves the futures to their results before the task runs.
    return index_corpus.submit(plan.without_chunks(), results).result()  # type: ignore[arg-type]


def start_charlm_run(
    params: CharLMParams,
    settings: Settings,
    data_sha256: str,
    corpus: FormattedCorpus,
    datasets: list[DatasetRef],
    world_size: int,
    tags: dict[str, str] | None = None,
    parent: RunRef | None = None,
) -> RunRef:
    """The pet-name training's MLflow run (see start_workload_run): its parameters name the
    corpus. With `parent`, a scaling run's child for `world_size`, recorded like a lone one."""
    return start_workload_run(
        settings,
        params.experiment,
        WORKLOAD,
        "A pet-name model (charlm)",
        datasets,
        {
            **params.model_dump(),
            "source": redact_url(params.source),
            "world_size": world_size,
            "data_sha256": data_sha256,
            "num_train_samples": corpus.num_train_samples,
        },
        tags,
        parent,
        world_size,
    )


def corpus_datasets(corpus: FormattedCorpus, source: str) -> list[DatasetRef]:
    """The train and holdout files the ranks read, with content digests."""
    inputs = [
        (
            "pet-names-train",
            corpus.train_uri,
            "training",
            {"names": corpus.num_train_names, "samples": corpus.num_train_samples},
        ),
        (
            "pet-names-holdout",
            corpus.val_uri,
            "validation",
            {"names": corpus.num_val_names, "samples": corpus.num_val_samples},
        ),
    ]
    return describe_datasets.submit(inputs, redact_url(source)).result()


def charlm_job(
    params: CharLMParams, corpus: FormattedCorpus, run: RunRef, checkpoint_dir: str
) -> CharLMTrainJob:
    """What every rank of the training gets: data, model, optimisation, run, checkpoints."""
    return CharLMTrainJob(
        train_uri=corpus.train_uri,
        val_uri=corpus.val_uri,
        model=CharLSTMConfig(
            hidden_size=params.hidden_size, num_layers=params.num_layers, dropout=params.dropout
        ),
        epochs=params.epochs,
        batch_size=params.batch_size,
        lr=params.lr,
        seed=params.seed,
        checkpoint_root=checkpoint_dir,
        keep_last=params.keep_last,
        run=run,
        speed=SpeedSettings(params.precision, pin_memory=params.pin_memory, compile=params.compile),
        checkpoint_every_steps=params.checkpoint_every_steps,
        checkpoint_every_s=params.checkpoint_every_s,
        global_batch=params.global_batch,
    )


def _train_evaluate_register(
    params: CharLMParams,
    corpus: FormattedCorpus,
    run: RunRef,
    run_dir: str,
    world_size: int,
    launch: LaunchSettings,
) -> CharLMSummary:
    checkpoint_dir = storage.join(run_dir, "checkpoints")
    job = charlm_job(params, corpus, run, checkpoint_dir)
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
    evaluation = evaluate.submit(
        run, checkpoint, corpus, params.num_names, params.seed, storage.join(run_dir, "reports")
    ).result()
    version = register_trained(WORKLOAD, run, checkpoint, params.model_name)
    return CharLMSummary(
        run_id=run.run_id,
        experiment_id=run.experiment_id,
        final_val_loss=evaluation.val_loss,
        names=evaluation.names,
        novel_fraction=evaluation.novel_fraction,
        checkpoint_uri=checkpoint,
        checkpoint_dir=checkpoint_dir,
        model_version=version,
        world_size=trained.world_sizes[-1] if trained.world_sizes else world_size,
        world_sizes=trained.world_sizes,
        unsent=trained.unsent,
        kept=storage.folder_usage(checkpoint_dir, ".pt"),
    )
