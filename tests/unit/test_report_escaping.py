"""Names from data (class folders, generated names) are text in every report: no link, no
markup in the markdown, no formula in the CSV (ddpflow.workloads.escape)."""

from __future__ import annotations

import csv
import io

import pytest

from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.charlm.report import EvalResult
from ddpflow.workloads.charlm.report import evaluation_markdown as charlm_markdown
from ddpflow.workloads.escape import csv_cell, from_csv_cell, markdown_text
from ddpflow.workloads.vision.evaluation import evaluation_markdown
from ddpflow.workloads.vision.reports import ImageEvalResult, confusion_csv, read_confusion_csv

HOSTILE = [
    "[click me](http://evil.example/x)",
    "<img src=x onerror=alert(1)>",
    '=HYPERLINK("http://evil.example","open")',
    "+cmd|' /C calc'!A0",
    "-2+3",
    "@SUM(A1)",
    "a | b\nsecond line",
    "**bold** `code` # heading",
]
RUN = RunRef("file:///nowhere", "0123abcd")


def _rendered_risks(markdown: str) -> list[str]:
    """What a markdown renderer would turn into a link, an image, HTML or a new table cell."""
    risks = []
    if "](" in markdown.replace("\\](", "").replace("]\\(", ""):
        risks.append("a link")
    if "<img" in markdown or "<script" in markdown:
        risks.append("raw HTML")
    if "http://" in markdown:
        risks.append("an autolink")
    return risks


@pytest.mark.parametrize("name", HOSTILE)
def test_a_name_from_data_is_plain_text_in_markdown(name: str) -> None:
    shown = markdown_text(name)
    assert _rendered_risks(shown) == [], shown
    assert "\n" not in shown
    assert "|" not in shown.replace("\\|", "")  # no unescaped cell separator


def test_the_image_evaluation_markdown_shows_hostile_classes_as_text() -> None:
    result = ImageEvalResult(
        0.5, 0.5, 8, HOSTILE, [[1] * len(HOSTILE) for _ in HOSTILE],
        "s3://b/k?X-Amz-Signature=SIG7", 1,
    )  # fmt: skip
    markdown = evaluation_markdown(RUN, result, num_bad=0)
    assert _rendered_risks(markdown) == [], markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    # Each class row has exactly its three cells, whatever the name holds.
    class_rows = rows[-len(HOSTILE) :]
    assert all(row.replace("\\|", "").count("|") == 4 for row in class_rows), class_rows
    assert "SIG7" not in markdown


def test_the_charlm_evaluation_markdown_shows_generated_names_as_text() -> None:
    from types import SimpleNamespace

    corpus = SimpleNamespace(num_val_names=1, num_val_samples=2)
    result = EvalResult(1.0, HOSTILE, 0.5, "/tmp/ckpt", 1)
    markdown = charlm_markdown(RUN, result, corpus)  # type: ignore[arg-type]
    assert _rendered_risks(markdown) == [], markdown


def test_the_confusion_csv_holds_no_formula_and_reads_back_the_names() -> None:
    confusion = [[i + j for j in range(len(HOSTILE))] for i in range(len(HOSTILE))]
    text = confusion_csv(HOSTILE, confusion)
    cells = [cell for row in csv.reader(io.StringIO(text)) for cell in row]
    assert not [c for c in cells if c.startswith(("=", "+", "-", "@"))], cells
    assert read_confusion_csv(text) == (HOSTILE, confusion)


@pytest.mark.parametrize("text", ["plain", "'quoted", "'=already", "=f()", "", "-1"])
def test_a_csv_cell_reads_back_as_given(text: str) -> None:
    assert from_csv_cell(csv_cell(text)) == text
