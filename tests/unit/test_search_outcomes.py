"""A searched trial's end as the flow records it: COMPLETE, PRUNED (at which epoch) or FAILED,
its place in the ranking, and the table rows with states (no cluster, no MLflow)."""

from __future__ import annotations

import math

from ddpflow.training.result import EpochStats
from ddpflow.workloads.sweep.config import validate_trial
from ddpflow.workloads.sweep.execute import TrialOutcome
from ddpflow.workloads.sweep.report import best, curves
from flows.search.run import _judged, search_rows, state_of

BASE = {
    "epochs": 4,
    "batch_size": 512,
    "lr": 0.01,
    "hidden_size": 16,
    "num_layers": 1,
    "dropout": 0.0,
    "seed": 0,
}


def _outcome(index: int, *val_losses: float, error: str | None = None) -> TrialOutcome:
    history = [EpochStats(i + 1, v + 0.1, v, 1000.0, 2.0) for i, v in enumerate(val_losses)]
    return TrialOutcome(
        validate_trial(index, BASE),
        run_id=f"run{index}",
        completed=error is None,
        history=history,
        checkpoint_uri=None if error else f"/ckpt/{index}",
        error=error,
    )


def test_a_trial_stopped_at_its_rung_is_pruned_there() -> None:
    pruned = _judged(_outcome(0, 2.0, 1.9), pruned_at=2)
    assert (pruned.pruned_at, pruned.completed, pruned.checkpoint_uri) == (2, False, None)
    assert state_of(pruned) == "PRUNED" and pruned.status == "pruned"
    assert math.isnan(pruned.final_val_loss), "a pruned trial is never ranked by its loss"


def test_a_stop_its_ranks_saw_late_prunes_it_where_it_stopped() -> None:
    assert _judged(_outcome(0, 2.0, 1.9, 1.8), pruned_at=2).pruned_at == 3


def test_a_trial_that_trained_all_its_epochs_is_complete_whatever_the_verdict() -> None:
    done = _judged(_outcome(0, 2.0, 1.9, 1.8, 1.7), pruned_at=2)
    assert done.completed and done.pruned_at is None and state_of(done) == "COMPLETE"


def test_a_crashed_trial_stays_failed() -> None:
    crashed = _judged(_outcome(0, 2.0, error="boom"), pruned_at=1)
    assert state_of(crashed) == "FAILED" and crashed.pruned_at is None


def test_the_best_is_a_completed_trial_even_when_a_pruned_one_had_a_lower_loss() -> None:
    complete = _outcome(0, 2.0, 1.9, 1.8, 1.7)
    pruned = _judged(_outcome(1, 1.0), pruned_at=1)
    assert best([complete, pruned]) is complete
    rows = search_rows([pruned, complete])
    assert [(r["trial"], r["rank"], r["state"]) for r in rows] == [
        (0, 1, "COMPLETE"),
        (1, None, "PRUNED"),
    ]
    assert rows[1]["pruned_at_epoch"] == 1 and rows[1]["epochs_trained"] == 1
    assert rows[1]["last_val_loss"] == 1.0 and rows[1]["val_loss"] is None
    (curve,) = curves([pruned])
    assert curve.note == "pruned: stopped by the pruner after epoch 1"
