"""A scaling run's numbers: steady samples/s, efficiency, time to target, table and plots."""

from __future__ import annotations

import csv
import io
import math

import pytest

from ddpflow.training.result import EpochStats
from ddpflow.workloads.scaling import SizeResult, Target, table_rows
from ddpflow.workloads.scaling.plots import PLOT_NAMES, scaling_plots
from ddpflow.workloads.scaling.report import (
    NOT_REACHED,
    csv_text,
    efficiency,
    markdown_table,
    steady_samples_per_s,
    time_to_target,
)
from flows.scaling import ScalingSummary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOSS = Target("val_loss", 2.0)
ACCURACY = Target("val_accuracy", 0.9, higher_is_better=True)


def _epoch(epoch: int, rate: float, seconds: float, val_loss: float = 3.0, **val) -> EpochStats:
    return EpochStats(epoch, val_loss + 0.1, val_loss, rate, seconds, dict(val))


def _size(size: int, *rates: float, losses: tuple[float, ...] = (), ok: bool = True):
    losses = losses or (3.0,) * len(rates)
    history = [
        _epoch(i + 1, r, 10.0, v) for i, (r, v) in enumerate(zip(rates, losses, strict=True))
    ]
    return SizeResult(size, f"run{size}", ok, history if ok else [], 30.0, None if ok else "boom")


def test_steady_rate_skips_the_first_epoch_and_weighs_by_time() -> None:
    history = [_epoch(1, 10.0, 5.0), _epoch(2, 100.0, 1.0), _epoch(3, 200.0, 3.0)]
    # (100 x 1 + 200 x 3) samples over 4 s; the warm-up epoch's 10/s is left out.
    assert steady_samples_per_s(history) == pytest.approx(175.0)


# docs/scaling.md: an epoch a restart cut into (resumed from a checkpoint inside it) is
# never in the steady rate.
def test_steady_rate_leaves_out_an_epoch_a_restart_cut_into() -> None:
    cut = EpochStats(3, 3.1, 3.0, 20.0, 1.0, resumed_at_step=40)
    history = [_epoch(1, 10.0, 5.0), _epoch(2, 100.0, 1.0), cut, _epoch(4, 200.0, 3.0)]
    assert steady_samples_per_s(history) == pytest.approx(175.0)
    # A cut first epoch is left out as a cut one; the epoch after it is whole and counts.
    assert steady_samples_per_s([cut, _epoch(4, 200.0, 3.0)]) == pytest.approx(200.0)
    assert math.isnan(steady_samples_per_s([cut]))


def test_steady_rate_of_a_single_epoch_is_that_epoch() -> None:
    assert steady_samples_per_s([_epoch(1, 42.0, 2.0)]) == 42.0
    assert math.isnan(steady_samples_per_s([]))


def test_efficiency_is_against_linear_scaling_of_size_one() -> None:
    assert efficiency(150.0, 2, 100.0) == pytest.approx(0.75)
    assert efficiency(400.0, 4, 100.0) == pytest.approx(1.0)
    assert efficiency(150.0, 2, None) is None  # no size 1 in this run: no efficiency


def test_time_to_target_is_training_seconds_to_the_first_epoch_that_reached_it() -> None:
    history = [_epoch(1, 1.0, 4.0, 2.5), _epoch(2, 1.0, 3.0, 1.9), _epoch(3, 1.0, 2.0, 1.5)]
    assert time_to_target(history, LOSS) == pytest.approx(7.0)  # epochs 1 and 2
    assert time_to_target(history, Target("val_loss", 1.0)) is None


def test_accuracy_targets_count_up() -> None:
    history = [_epoch(1, 1.0, 4.0, val_accuracy=0.5), _epoch(2, 1.0, 2.0, val_accuracy=0.95)]
    assert time_to_target(history, ACCURACY) == pytest.approx(6.0)
    assert ACCURACY.label() == "val_accuracy >= 0.9"


def test_table_rows_efficiency_and_targets_per_size() -> None:
    results = [
        _size(2, 50.0, 160.0, losses=(2.5, 2.5)),  # given out of order: rows go by size
        _size(1, 50.0, 100.0, losses=(2.5, 1.5)),
    ]
    rows = table_rows(results, LOSS)
    assert [r["world_size"] for r in rows] == [1, 2]
    assert [r["samples_per_s"] for r in rows] == [100.0, 160.0]
    assert [r["efficiency"] for r in rows] == [1.0, 0.8]
    assert [r["time_to_target_s"] for r in rows] == [20.0, NOT_REACHED]
    assert [r["final_metric"] for r in rows] == [1.5, 2.5]


def test_without_size_one_or_a_target_the_columns_stay_empty() -> None:
    rows = table_rows([_size(2, 80.0, 80.0)], Target("val_loss", None))
    assert rows[0]["efficiency"] is None and rows[0]["time_to_target_s"] is None


def test_a_failed_size_is_a_row_with_its_error_and_no_numbers() -> None:
    rows = table_rows([_size(1, 90.0, 100.0), _size(2, ok=False)], LOSS)
    failed = rows[1]
    assert failed["status"] == "failed" and failed["error"] == "boom"
    assert failed["samples_per_s"] is None and failed["efficiency"] is None
    assert failed["time_to_target_s"] is None


def test_markdown_and_csv_carry_the_same_rows() -> None:
    rows = table_rows([_size(1, 90.0, 100.0), _size(2, 90.0, 150.0)], LOSS)
    markdown = markdown_table(rows, LOSS)
    lines = markdown.splitlines()
    assert lines[0].startswith("| world_size | status | samples_per_s | efficiency |")
    assert "s to val_loss <= 2" in lines[0] and "final val_loss" in lines[0]
    assert lines[3].startswith("| 2 | completed | 150 | 0.75 |")
    parsed = list(csv.DictReader(io.StringIO(csv_text(rows))))
    assert [(r["world_size"], r["efficiency"]) for r in parsed] == [("1", "1.0"), ("2", "0.75")]


def test_plots_are_pngs_with_or_without_a_baseline() -> None:
    for results in ([_size(1, 9.0, 10.0), _size(2, 9.0, 15.0)], [_size(2, ok=False)]):
        pngs = scaling_plots(table_rows(results, LOSS), "charlm")
        assert set(pngs) == set(PLOT_NAMES.values())
        assert all(data.startswith(PNG_MAGIC) for data in pngs.values())


def test_the_summary_prints_the_table_and_counts() -> None:
    rows = table_rows([_size(1, 9.0, 10.0), _size(2, ok=False)], LOSS)
    summary = ScalingSummary("charlm", "parent1", rows, markdown_table(rows, LOSS), "k")
    text = summary.render("open it")
    assert "charlm scaling finished, 1 of 2 world sizes completed" in text
    assert markdown_table(rows, LOSS) in text and "Prefect artifact k" in text
