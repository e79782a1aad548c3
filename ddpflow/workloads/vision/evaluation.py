"""Validation of the final checkpoint (confusion matrix, per-class accuracy) and registration."""

from __future__ import annotations

import os
import re
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from ddpflow import storage
from ddpflow.checkpoint.store import CheckpointStore
from ddpflow.registry.serving import register_checkpoint_model
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.escape import markdown_text
from ddpflow.workloads.vision.config import ImageModelConfig, ModelConfigError
from ddpflow.workloads.vision.data import open_split
from ddpflow.workloads.vision.metrics import confusion_matrix, predict
from ddpflow.workloads.vision.model import ImageClassifier, build_resnet
from ddpflow.workloads.vision.reports import (
    ImageEvalResult,
    confusion_csv,
    confusion_png,
    per_class_json,
)

REPORT_FILES = ("confusion_matrix.csv", "confusion_matrix.png", "per_class_accuracy.json")


def load_model(checkpoint_uri: str) -> tuple[ImageClassifier, ImageModelConfig, int]:
    state = CheckpointStore(checkpoint_uri.rsplit("/", 1)[0]).load(checkpoint_uri)
    try:
        config = ImageModelConfig.from_dict(state["model_config"])
        head = state["model_state"].get("backbone.fc.weight")
        if head is None or tuple(head.shape)[:1] != (config.num_classes,):
            found = "missing" if head is None else tuple(head.shape)
            raise ModelConfigError(
                f"model_config.num_classes={config.num_classes} does not match the "
                f"checkpoint's head (backbone.fc.weight is {found})"
            )
    except ModelConfigError as error:
        raise ModelConfigError(
            f"{checkpoint_uri}: {error}; pass a checkpoint written by ddpflow's image training"
        ) from None
    # No pretrained weights to fetch: the checkpoint holds every weight.
    model = build_resnet(config.arch, config.num_classes, "none", config.freeze_backbone)
    model.load_state_dict(state["model_state"])
    return model.eval(), config, int(state["epoch"])


def evaluate_checkpoint(
    checkpoint_uri: str, val_uri: str, batch_size: int = 256
) -> ImageEvalResult:
    """Loss, accuracy and confusion matrix of a checkpoint on the validation split."""
    torch.set_num_threads(1)  # runs on a 1-thread Dask worker next to other work
    model, config, epoch = load_model(checkpoint_uri)
    val = open_split(val_uri)
    logits, labels = predict(model, val, torch.arange(len(val)), batch_size)
    predictions = logits.argmax(1)
    return ImageEvalResult(
        val_loss=F.cross_entropy(logits, labels).item(),
        val_accuracy=(predictions == labels).float().mean().item(),
        num_val=len(labels),
        classes=list(config.classes),
        confusion=confusion_matrix(labels, predictions, config.num_classes),
        checkpoint_uri=checkpoint_uri,
        epoch=epoch,
    )


def report_files(result: ImageEvalResult, markdown: str) -> dict[str, bytes]:
    title = f"validation, epoch {result.epoch}: accuracy {result.val_accuracy:.1%}"
    return {
        "confusion_matrix.csv": confusion_csv(result.classes, result.confusion).encode(),
        "confusion_matrix.png": confusion_png(result.classes, result.confusion, title),
        "per_class_accuracy.json": per_class_json(result.classes, result.confusion).encode(),
        "evaluation.md": markdown.encode(),
    }


def save_reports(report_dir: str, files: dict[str, bytes]) -> list[str]:
    uris = [storage.join(report_dir, name) for name in files]
    for uri, data in zip(uris, files.values(), strict=True):
        storage.write_bytes(uri, data)
    return uris


def log_evaluation(run: RunRef, result: ImageEvalResult, files: dict[str, bytes]) -> None:
    """Final metrics, one accuracy metric per class, and the report files under evaluation/."""
    client = MlflowClient(run.tracking_uri)
    client.log_metric(run.run_id, "final_val_loss", result.val_loss, step=result.epoch)
    client.log_metric(run.run_id, "final_val_accuracy", result.val_accuracy, step=result.epoch)
    for name, row in result.per_class.items():
        if row["accuracy"] is not None:
            key = f"val_class_accuracy/{_metric_safe(name)}"
            client.log_metric(run.run_id, key, float(row["accuracy"]), step=result.epoch)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        client.log_artifacts(run.run_id, tmp, "evaluation")


def _metric_safe(name: str) -> str:
    # MLflow metric names allow letters, digits, _ - . / and spaces.
    return re.sub(r"[^\w\-. /]", "_", name)


def evaluation_markdown(run: RunRef, result: ImageEvalResult, num_bad: int) -> str:
    rows = "\n".join(
        f"| {markdown_text(name)} | {_percent(r['accuracy'])} | {r['correct']} / {r['support']} |"
        for name, r in result.per_class.items()
    )
    return (
        f"# Image classifier evaluation\n\n"
        f"| | |\n|---|---|\n"
        f"| MLflow run | `{run.run_id}` |\n"
        f"| epoch | {result.epoch} |\n"
        f"| validation accuracy | {result.val_accuracy:.2%} |\n"
        f"| majority-class baseline | {result.baseline_accuracy:.2%} |\n"
        f"| validation loss | {result.val_loss:.4f} |\n"
        f"| validation images | {result.num_val} |\n"
        f"| unreadable files skipped | {num_bad} |\n"
        f"| checkpoint | `{redact_url(result.checkpoint_uri)}` (the last epoch's, registered) |\n\n"
        + "".join(f"> **Warning:** {w}.\n\n" for w in result.warnings(quote=markdown_text))
        + "## Per-class accuracy\n\n| class | accuracy | correct / images |\n|---|---|---|\n"
        f"{rows}\n"
    )


def _percent(value: float | int | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def register_model(run: RunRef, checkpoint_uri: str, registered_name: str) -> str:
    """Register the checkpoint's model; it takes uint8 images [N, 3, S, S] (the formatted
    layout) and returns logits. The version is tagged with its checkpoint, which is what
    champion/challenger scoring loads."""
    model, config, _ = load_model(checkpoint_uri)
    size = config.image_size
    return register_checkpoint_model(
        run,
        model,
        np.zeros((2, 3, size, size), dtype=np.uint8),
        registered_name,
        checkpoint_uri,
        quiet_warnings=[{"category": UserWarning, "module": "torch"}],
    )
