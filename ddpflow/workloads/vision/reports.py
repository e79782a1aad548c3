"""What the image evaluation found (ImageEvalResult) and its files: confusion matrix (CSV
for tools, PNG for people), per-class JSON.

Torch-free, and matplotlib is imported only to draw: the evaluation task returns an
ImageEvalResult to the flow process, which unpickles it by importing this module, and that
process starts and stays without torch (integration/test_flow_imports.py).

Plots use `matplotlib.figure.Figure` directly, not pyplot: no global state and no GUI
backend, so they render in any thread and on machines without a display (Agg).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ddpflow.cluster.extras import missing_extra
from ddpflow.workloads.escape import csv_cell, from_csv_cell

MAX_ANNOTATED_CLASSES = 30  # beyond this, counts in cells are unreadable


@dataclass(frozen=True)
class ImageEvalResult:
    val_loss: float
    val_accuracy: float
    num_val: int
    classes: list[str]
    confusion: list[list[int]]  # [true][predicted]
    checkpoint_uri: str
    epoch: int

    @property
    def per_class(self) -> dict[str, dict[str, float | int | None]]:
        return per_class_report(self.classes, self.confusion)

    @property
    def baseline_accuracy(self) -> float:
        """What always answering the validation set's most common class scores: the figure
        an accuracy means something only above (1/classes on a balanced set)."""
        supports = [sum(row) for row in self.confusion]
        return max(supports) / sum(supports) if sum(supports) else float("nan")

    @property
    def single_prediction(self) -> str | None:
        """The class every validation image was predicted as, when it was one class for all
        (a collapsed model); None otherwise."""
        predicted = [sum(column) for column in zip(*self.confusion, strict=True)]
        used = [name for name, count in zip(self.classes, predicted, strict=True) if count]
        return used[0] if len(used) == 1 and len(self.classes) > 1 and self.num_val > 1 else None

    @property
    def no_better_than_baseline(self) -> bool:
        """No more images right than the baseline gets: counted in images, as a float32
        accuracy of 8/24 compares above 1/3."""
        right = sum(row[i] for i, row in enumerate(self.confusion))
        return not right > max((sum(row) for row in self.confusion), default=0)

    def warnings(self, quote: Callable[[str], str] = str) -> list[str]:
        """What makes this accuracy no result, in words (empty when nothing does); `quote`
        escapes the class name, which comes from the data, for where the text goes."""
        found = []
        if self.single_prediction is not None:
            found.append(
                "every validation image was predicted as one class "
                f"({quote(self.single_prediction)})"
            )
        if self.no_better_than_baseline:
            found.append(
                f"accuracy {self.val_accuracy:.2%} is no better than always answering the "
                f"most common class ({self.baseline_accuracy:.2%})"
            )
        return found


def per_class_accuracy(confusion: list[list[int]]) -> list[float | None]:
    """Share of each true class predicted correctly (recall); None for a class with no sample."""
    return [row[i] / sum(row) if sum(row) else None for i, row in enumerate(confusion)]


def confusion_csv(classes: Sequence[str], confusion: Sequence[Sequence[int]]) -> str:
    """Rows are true classes, columns predicted ones; the header row names the columns.
    Class names are cells no spreadsheet evaluates (ddpflow.workloads.escape)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["true\\predicted", *(csv_cell(name) for name in classes)])
    for name, row in zip(classes, confusion, strict=True):
        writer.writerow([csv_cell(name), *row])
    return buffer.getvalue()


def read_confusion_csv(text: str) -> tuple[list[str], list[list[int]]]:
    rows = list(csv.reader(io.StringIO(text)))
    classes = [from_csv_cell(name) for name in rows[0][1:]]
    return classes, [[int(v) for v in row[1:]] for row in rows[1:]]


def per_class_report(
    classes: Sequence[str], confusion: Sequence[Sequence[int]]
) -> dict[str, dict[str, float | int | None]]:
    """{class: {accuracy, correct, support}}; accuracy is None for a class with no sample."""
    accuracy = per_class_accuracy([list(r) for r in confusion])
    return {
        name: {"accuracy": accuracy[i], "correct": int(confusion[i][i]), "support": sum(row)}
        for i, (name, row) in enumerate(zip(classes, confusion, strict=True))
    }


def per_class_json(classes: Sequence[str], confusion: Sequence[Sequence[int]]) -> str:
    return json.dumps(per_class_report(classes, confusion), indent=2)


def confusion_png(classes: Sequence[str], confusion: Sequence[Sequence[int]], title: str) -> bytes:
    # Drawing runs on a worker (see the module docstring); matplotlib is the `plots` extra.
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise missing_extra("plots", "the confusion matrix (confusion_png)", error) from None

    size = min(14.0, 3.0 + 0.45 * len(classes))
    figure = Figure(figsize=(size, size * 0.9), dpi=100)
    axes = figure.add_subplot()
    image = axes.imshow(confusion, cmap="Blues")
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)
    ticks = range(len(classes))
    axes.set_xticks(ticks, labels=list(classes), rotation=90 if len(classes) > 10 else 0)
    axes.set_yticks(ticks, labels=list(classes))
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    axes.set_title(title)
    if len(classes) <= MAX_ANNOTATED_CLASSES:
        peak = max((max(row) for row in confusion), default=0)
        for i, row in enumerate(confusion):
            for j, count in enumerate(row):
                color = "white" if count > peak / 2 else "black"
                axes.text(j, i, str(count), ha="center", va="center", color=color, fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
