"""Comparing trials: ranking, table rows, elapsed seconds, plots (PNG) and the summary."""

from __future__ import annotations

import pytest

from ddpflow.training.result import EpochStats
from ddpflow.workloads.sweep.config import validate_trial
from ddpflow.workloads.sweep.execute import TrialOutcome
from ddpflow.workloads.sweep.plots import LossCurve, loss_panels_png
from ddpflow.workloads.sweep.report import best, curves, plots, ranked, table_rows
from ddpflow.workloads.sweep.trial import elapsed_by_epoch
from flows.sweep_summary import SweepSummary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASE = {
    "epochs": 2,
    "batch_size": 512,
    "lr": 0.01,
    "hidden_size": 16,
    "num_layers": 1,
    "dropout": 0.0,
    "seed": 0,
}


def _history(*val_losses: float) -> list[EpochStats]:
    return [EpochStats(i + 1, v + 0.1, v, 1000.0, 2.0 + i) for i, v in enumerate(val_losses)]


def _outcome(index: int, *val_losses: float, error: str | None = None, **values) -> TrialOutcome:
    spec = validate_trial(index, {**BASE, **values})
    return TrialOutcome(
        spec,
        run_id=f"run{index}",
        completed=error is None and spec.valid,
        history=_history(*val_losses),
        checkpoint_uri=f"/ckpt/{index}.pt" if error is None else None,
        error=error if spec.valid else "; ".join(spec.errors),
    )


@pytest.fixture
def outcomes() -> list[TrialOutcome]:
    return [
        _outcome(0, 2.0, 1.8),
        _outcome(1, 1.9, 1.5, lr=0.02),
        _outcome(2, lr=-1),  # invalid
        _outcome(3, 2.1, error="LaunchError: boom"),  # crashed after one epoch
        _outcome(4, 2.0, float("nan")),  # diverged
        _outcome(5, 1.9, 1.6),
    ]


def test_elapsed_seconds_accumulate_epoch_times() -> None:
    assert elapsed_by_epoch(_history(3.0, 2.0, 1.0)) == [(1, 2.0), (2, 5.0), (3, 9.0)]
    assert elapsed_by_epoch([]) == []


def test_ranking_is_by_final_val_loss_then_failed_by_index(outcomes) -> None:
    assert [o.spec.index for o in ranked(outcomes)] == [1, 5, 0, 2, 3, 4]
    assert best(outcomes).run_id == "run1"


def test_no_best_when_nothing_completed() -> None:
    assert best([_outcome(0, lr=-1), _outcome(1, 2.0, error="x")]) is None
    assert best([]) is None


def test_table_rows_rank_completed_and_explain_failures(outcomes) -> None:
    rows = table_rows(outcomes)
    assert [r["rank"] for r in rows] == [1, 2, 3, None, None, None]
    top = rows[0]
    assert top["trial"] == 1 and top["status"] == "completed" and top["lr"] == 0.02
    assert top["val_loss"] == 1.5 and top["elapsed_s"] == 5.0 and top["run_id"] == "run1"
    invalid = next(r for r in rows if r["trial"] == 2)
    assert invalid["status"] == "failed" and invalid["lr"] == -1, "shows the value given"
    assert "trials[2].lr=-1: must be > 0" in invalid["error"]
    assert invalid["val_loss"] is None
    crashed = next(r for r in rows if r["trial"] == 3)
    assert crashed["error"] == "LaunchError: boom" and crashed["val_loss"] is None
    diverged = next(r for r in rows if r["trial"] == 4)
    assert diverged["status"] == "completed" and diverged["val_loss"] is None


def test_curves_in_trial_order_with_notes_for_failures(outcomes) -> None:
    data = curves(outcomes)
    assert [c.title.split(":")[0] for c in data] == [f"trial-{i}" for i in range(6)]
    assert data[0].epochs == [1, 2] and data[0].elapsed_s == [2.0, 5.0]
    assert data[0].note is None
    assert data[2].title.endswith("invalid config") and "lr=-1" in data[2].note
    assert data[3].epochs == [1], "a crashed trial keeps the epochs it finished"
    assert data[3].note.startswith("failed: LaunchError")


def test_plots_are_pngs_for_epoch_and_elapsed(outcomes) -> None:
    pngs = plots(outcomes)
    assert set(pngs) == {"loss_vs_epoch.png", "loss_vs_elapsed.png"}
    for data in pngs.values():
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_one_panel_per_trial_wraps_at_four_columns() -> None:
    from io import BytesIO

    from matplotlib.image import imread

    curve = LossCurve("t", [1, 2], [1.0, 2.0], [2.0, 1.5], [1.9, 1.6])
    one = imread(BytesIO(loss_panels_png([curve], "epoch", dpi=50)))
    four = imread(BytesIO(loss_panels_png([curve] * 4, "epoch", dpi=50)))
    six = imread(BytesIO(loss_panels_png([curve] * 6, "elapsed_s", dpi=50)))
    assert four.shape[1] > 3 * one.shape[1], "four panels side by side"
    assert six.shape[1] == four.shape[1] and six.shape[0] > 1.5 * four.shape[0], "two rows"


def test_plotting_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no trials to plot"):
        loss_panels_png([], "epoch")


def _summary(outcomes: list[TrialOutcome], **fields) -> SweepSummary:
    """The summary as the flow builds it: counts and the best trial come from the outcomes."""
    top = best(outcomes)
    return SweepSummary(
        parent_run_id="parent",
        rows=table_rows(outcomes),
        num_completed=sum(o.completed for o in outcomes),
        best_run_id=top.run_id if top else None,
        best_val_loss=top.final_val_loss if top else None,
        model_name="m",
        table_key="charlm-sweep",
        **{"model_version": None, "promotion": None, "promoted": False, **fields},
    )


def test_summary_renders_table_best_trial_and_promotion(outcomes) -> None:
    summary = _summary(outcomes, model_version="3", promotion="no champion yet", promoted=True)
    text = summary.render("mlflow ui ...")
    # The diverged trial completed (it counts) but is never the best one.
    assert "4 of 6 trials completed" in text
    assert "run run1, val loss 1.5000" in text and "m version 3" in text
    assert "promoted to champion: no champion yet" in text
    assert "trials[2].lr=-1: must be > 0" in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("---")) + 1
    table = [
        line.split()
        for line in lines[start : start + 9]
        if line.strip() and not line.strip().startswith("error:")
    ]
    assert [row[1] for row in table] == ["1", "5", "0", "2", "3", "4"], "ranking order"
    diverged = next(row for row in table if row[1] == "4")
    assert diverged[0] == "-" and diverged[8] == "-", "a NaN loss shows as no rank, no loss"


def test_summary_without_a_completed_trial_names_no_best_and_no_model() -> None:
    # docs/sweeps.md "Failures stay local": the sweep fails only if no trial completes.
    outcomes = [_outcome(0, lr=-1), _outcome(1, 2.0, error="LaunchError: boom")]
    text = _summary(outcomes).render("mlflow ui ...")
    assert "0 of 2 trials completed" in text
    assert "best trial         none (no trial completed)" in text
    assert "registered model" not in text and "champion" not in text
    assert "error: LaunchError: boom" in text
