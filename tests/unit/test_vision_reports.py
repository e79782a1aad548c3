"""Confusion matrix, per-class accuracy and the report files."""

from __future__ import annotations

import json

import torch

from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.vision.evaluation import evaluation_markdown, report_files
from ddpflow.workloads.vision.metrics import confusion_matrix
from ddpflow.workloads.vision.reports import (
    ImageEvalResult,
    confusion_csv,
    per_class_accuracy,
    read_confusion_csv,
)

CLASSES = ["cat", "dog", "bird, small"]
TARGETS = torch.tensor([0, 0, 0, 1, 1, 2])
PREDICTIONS = torch.tensor([0, 0, 1, 1, 0, 2])


def test_confusion_matrix_rows_are_true_classes() -> None:
    confusion = confusion_matrix(TARGETS, PREDICTIONS, 3)
    assert confusion == [[2, 1, 0], [1, 1, 0], [0, 0, 1]]
    assert sum(map(sum, confusion)) == len(TARGETS)
    assert per_class_accuracy(confusion) == [2 / 3, 0.5, 1.0]
    assert per_class_accuracy([[0, 0], [1, 1]]) == [None, 0.5]


def test_csv_round_trips_with_awkward_class_names() -> None:
    confusion = confusion_matrix(TARGETS, PREDICTIONS, 3)
    text = confusion_csv(CLASSES, confusion)
    assert text.splitlines()[0] == 'true\\predicted,cat,dog,"bird, small"'
    assert read_confusion_csv(text) == (CLASSES, confusion)


def test_report_files_hold_csv_png_json_and_markdown() -> None:
    result = ImageEvalResult(
        val_loss=0.5,
        val_accuracy=4 / 6,
        num_val=6,
        classes=CLASSES,
        confusion=confusion_matrix(TARGETS, PREDICTIONS, 3),
        checkpoint_uri="s3://b/runs/r/checkpoints/epoch-0002.pt",
        epoch=2,
    )
    markdown = evaluation_markdown(RunRef("sqlite:///x.db", "run123"), result, num_bad=1)
    files = report_files(result, markdown)
    assert files["confusion_matrix.png"].startswith(b"\x89PNG\r\n\x1a\n")
    per_class = json.loads(files["per_class_accuracy.json"])
    assert per_class["dog"] == {"accuracy": 0.5, "correct": 1, "support": 2}
    assert "| validation accuracy | 66.67% |" in markdown and "`run123`" in markdown
    assert "| dog | 50.0% | 1 / 2 |" in markdown and "| unreadable files skipped | 1 |" in markdown


def test_a_model_at_chance_shows_the_baseline_and_a_warning_in_its_report_and_summary() -> None:
    from ddpflow.config import Settings
    from flows.train_images import ImageSummary

    targets = torch.arange(3).repeat_interleave(8)  # 3 balanced classes of 8 images
    collapsed = torch.zeros_like(targets)  # every image predicted as the first class
    result = ImageEvalResult(
        val_loss=1.1,
        val_accuracy=(collapsed == targets).float().mean().item(),
        num_val=24,
        classes=CLASSES,
        confusion=confusion_matrix(targets, collapsed, 3),
        checkpoint_uri="/ckpt/epoch-0002.pt",
        epoch=2,
    )
    assert result.baseline_accuracy == 1 / 3 and result.single_prediction == "cat"
    markdown = evaluation_markdown(RunRef("sqlite:///x.db", "r" * 32), result, num_bad=0)
    assert "| majority-class baseline | 33.33% |" in markdown
    assert "predicted as one class (cat)" in markdown and "no better than" in markdown
    summary = ImageSummary(
        run_id="r", val_accuracy=result.val_accuracy, val_loss=1.1, num_val=24, num_skipped=0,
        checkpoint_uri="/ckpt/epoch-0002.pt", checkpoint_dir="/ckpt", report_dir="/reports",
        model_version="1", world_size=2, baseline_accuracy=result.baseline_accuracy,
        warnings=tuple(result.warnings()),
    )  # fmt: skip
    text = summary.render(Settings.from_env({}))
    assert "33.33% of 24 images (majority-class baseline 33.33%)" in text
    assert text.count("WARNING") == 2 and "ddpflow.no_better_than_baseline" in text

    learned = ImageEvalResult(**{**result.__dict__, "val_accuracy": 0.9, "confusion": [
        [8, 0, 0], [1, 7, 0], [0, 1, 7]]})  # fmt: skip
    assert learned.warnings() == [] and learned.single_prediction is None
