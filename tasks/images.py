"""Prefect tasks for image classification: each calls ddpflow and returns URIs and numbers."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from ddpflow.shards.encoding import RAW, ShardEncoding
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.vision.data import FormattedImages, ImageSpec, format_image_folder
from ddpflow.workloads.vision.digits import DigitsFolder, ensure_digits
from ddpflow.workloads.vision.image_folder import describe_keys
from ddpflow.workloads.vision.objects import DEFAULT_MAX_IMAGE_MB
from ddpflow.workloads.vision.reports import ImageEvalResult
from ddpflow.workloads.vision.shard_format import (
    ChunkResult,
    ChunkTarget,
    ImageChunk,
    ShardPlan,
    format_chunk,
    index_shards,
    plan_shards,
    reusable,
)
from tasks.restarts import DDPWorkload, RankFunction

# The Prefect artifact listing logging calls the MLflow run lacks (tasks.tracking_report).
INCOMPLETE_KEY = "images-tracking-incomplete"
# The image training, for tasks.restarts.train_ddp (the `train-ddp` task).
TRAINING = DDPWorkload(
    RankFunction("ddpflow.workloads.vision.training:train_rank"),
    "images-restarts",
    "images-progress",
    INCOMPLETE_KEY,
)


@task(name="prepare-digits")
def prepare_digits(root: str) -> DigitsFolder:
    """Write scikit-learn's digits as a PNG image folder at `root` unless it is there."""
    return ensure_digits(root)


@task(name="format-images")
def format_images(
    source: str,
    artifact_root: str,
    spec: ImageSpec,
    val_fraction: float,
    seed: int,
    max_bad_fraction: float,
    max_image_mb: float = DEFAULT_MAX_IMAGE_MB,
) -> FormattedImages:
    """List, decode, split and store the folder as tensors; warn about skipped files."""
    result = format_image_folder(
        source, artifact_root, spec, val_fraction, seed, max_bad_fraction, max_image_mb
    )
    _warn_bad(source, result)
    return result


def _warn_bad(source: str, result: FormattedImages) -> None:
    shown = redact_url(source)
    if result.bad:
        get_run_logger().warning(
            "skipped %d unreadable image file(s) of %d: %s",
            len(result.bad),
            result.num_files,
            describe_keys(shown, result.bad_images),
        )
    if result.ignored:
        get_run_logger().warning(
            "ignored %d file(s) without an image extension: %s",
            len(result.ignored),
            ", ".join(result.ignored[:10]) + (" ..." if len(result.ignored) > 10 else ""),
        )


@task(name="plan-image-shards")
def plan_image_shards(
    source: str,
    artifact_root: str,
    spec: ImageSpec,
    val_fraction: float,
    seed: int,
    max_image_mb: float,
    shard_mb: float,
    encoding: ShardEncoding = RAW,
) -> ShardPlan:
    """List and split the folder and cut it into chunks, one shard each (shard_format),
    written in `encoding`."""
    return plan_shards(
        source, artifact_root, spec, val_fraction, seed, max_image_mb, shard_mb, encoding
    )


@task(name="reuse-image-shards")
def reuse_image_shards(plan: ShardPlan) -> FormattedImages | None:
    """The stored shards of this format, when every one is still there."""
    return reusable(plan)


@task(name="format-image-chunk")
def format_image_chunk(target: ChunkTarget, chunk: ImageChunk) -> ChunkResult:
    """Decode one chunk of images on a worker and write it as one shard."""
    return format_chunk(target, chunk)


@task(name="index-image-shards")
def index_image_shards(
    plan: ShardPlan, results: list[ChunkResult], max_bad_fraction: float
) -> FormattedImages:
    """Check the unreadable share and the classes; write the split indexes and manifest."""
    result = index_shards(plan, results, max_bad_fraction)
    reused = sum(r.reused for r in results)
    get_run_logger().info(
        "%d shard(s) for %d train / %d validation images: %d written, %d reused",
        len(results),
        result.num_train,
        result.num_val,
        len(results) - reused,
        reused,
    )
    _warn_bad(plan.target.root, result)
    return result


@task(name="resolve-weights")
def prepare_weights(arch: str, weights: str, artifact_root: str) -> str | None:
    """Fetch or check the pretrained weights once, before any rank starts."""
    # Imported when the task runs, as below: the model and evaluation modules need torch,
    # and the flow process that imports this module starts without it.
    from ddpflow.workloads.vision.model import resolve_weights

    return resolve_weights(arch, weights, artifact_root)


@task(name="evaluate-images")
def evaluate(
    run: RunRef, checkpoint_uri: str, data: FormattedImages, report_dir: str
) -> ImageEvalResult:
    """Confusion matrix and per-class accuracy: to MLflow, the artifact store and Prefect."""
    from ddpflow.workloads.vision.evaluation import (
        evaluate_checkpoint,
        evaluation_markdown,
        log_evaluation,
        report_files,
        save_reports,
    )

    result = evaluate_checkpoint(checkpoint_uri, data.val_uri)
    markdown = evaluation_markdown(run, result, num_bad=len(data.bad))
    files = report_files(result, markdown)
    save_reports(report_dir, files)
    log_evaluation(run, result, files)
    create_markdown_artifact(
        markdown=markdown, key="images-evaluation", description="image classifier evaluation"
    )
    return result
