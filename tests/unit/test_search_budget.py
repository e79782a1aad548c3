"""A search's compute budget in trial-epochs: its parameter checks, and the count that stops
the asking (finished trials', running ones' so far, a resumed study's kept ones')."""

from __future__ import annotations

import pytest

from ddpflow.training.result import EpochStats
from ddpflow.workloads.sweep.config import MAX_TRIALS, validate_trial
from ddpflow.workloads.sweep.execute import TrialOutcome
from flows.params import (
    DEFAULT_N_TRIALS,
    ParameterError,
    SweepParams,
    validate_params,
)
from flows.search.board import SearchBoard
from flows.search.resume import spent_epochs

SPACE = {"lr": {"choices": [0.001, 0.01]}}
DEFAULTS = {
    "epochs": 4,
    "batch_size": 512,
    "lr": 0.005,
    "hidden_size": 32,
    "num_layers": 1,
    "dropout": 0.1,
    "seed": 0,
}


def outcome(index: int, epochs: int, completed: bool = True) -> TrialOutcome:
    history = [EpochStats(e, 1.0, 1.0, 1.0, 1.0) for e in range(1, epochs + 1)]
    return TrialOutcome(validate_trial(index, DEFAULTS), f"run{index}", completed, history)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # ASHA's first rung is min_epochs: a trial spends at least that many.
        (
            {"budget_epochs": 2, "min_epochs": 3, "epochs": 4},
            "budget_epochs=2: smaller than one trial's first rung (3 trial-epochs: min_epochs)",
        ),
        # With no pruner a trial trains all its epochs: the fewest the space lets it train.
        (
            {"budget_epochs": 2, "pruner": "none", "epochs": 3},
            "budget_epochs=2: smaller than one trial's first rung (3 trial-epochs",
        ),
        (
            {"budget_epochs": 1, "pruner": "none", "search": {"epochs": {"low": 2, "high": 5}}},
            "raise budget_epochs to at least 2",
        ),
        ({"budget_epochs": 0}, "budget_epochs=0"),
    ],
)
def test_a_budget_below_one_first_rung_is_refused_naming_the_field(
    values: dict, message: str
) -> None:
    with pytest.raises(ParameterError) as refused:
        validate_params(SweepParams, {"search": SPACE, **values})
    assert message in str(refused.value)


def test_a_budget_is_a_searchs_only() -> None:
    with pytest.raises(ParameterError, match="budget_epochs=8: only a search"):
        validate_params(SweepParams, {"grid": {"lr": [0.1]}, "budget_epochs": 8})


def test_either_budget_or_both() -> None:
    assert SweepParams(search=SPACE).trials_to_ask() == DEFAULT_N_TRIALS
    # A budget in trial-epochs alone: the trials are bounded only by the sweep's cap.
    assert SweepParams(search=SPACE, budget_epochs=12).trials_to_ask() == MAX_TRIALS
    both = SweepParams(search=SPACE, budget_epochs=12, n_trials=5, min_epochs=1)
    assert (both.trials_to_ask(), both.budget_epochs) == (5, 12)
    assert SweepParams(search=SPACE, budget_epochs=1, min_epochs=1).first_rung() == 1


def test_the_board_counts_finished_running_and_kept_trial_epochs() -> None:
    board = SearchBoard(n_trials=10, max_epochs=4, budget_epochs=8, spent_before=3)
    assert board.spent == 3 and not board.budget_reached()
    board.started(0)
    board.started(1)
    board.epoch_done(0, 1)
    board.epoch_done(0, 2)
    board.epoch_done(1, 1)
    assert board.spent == 3 + 2 + 1
    board.ended(0, outcome(0, epochs=2, completed=False))  # pruned or failed after 2
    assert board.spent == 3 + 2 + 1 and not board.budget_reached()
    board.epoch_done(1, 2)
    board.epoch_done(1, 3)
    assert board.spent == 3 + 2 + 3 and board.budget_reached()
    line = board.ended(1, outcome(1, epochs=4))  # it goes on to its end past the budget
    assert board.spent == 3 + 2 + 4
    assert "9 trial-epochs spent of a budget of 8 (112 %)" in line, line
    assert board._percent() == 100.0


def test_without_a_budget_the_board_never_stops_the_asking() -> None:
    board = SearchBoard(n_trials=4, max_epochs=4)
    board.started(0)
    for epoch in range(1, 5):
        board.epoch_done(0, epoch)
    assert not board.budget_reached()
    assert "trial-epochs spent (the trials trained" in board.ended(0, outcome(0, epochs=4))
    assert board._percent() == 25.0


def test_a_resumed_study_counts_its_kept_trials_epochs() -> None:
    assert spent_epochs([outcome(0, 4), outcome(1, 1, completed=False), outcome(2, 2)]) == 7
