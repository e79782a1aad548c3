"""A point the study asks again is told the earlier trial's result, not trained again: a
sampler over choices repeats points, and with the trials' one training seed a second run of
a point spends its epochs on the same losses."""

from __future__ import annotations

from typing import Any

from optuna.trial import TrialState

from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.sweep import SweepSetup, WorkerSlots
from ddpflow.workloads.sweep.space import parse_space
from flows.params import SweepParams
from flows.search.board import MAX_REPEATS_IN_A_ROW, SearchBoard
from flows.search.resume import Resumed, kept_outcomes, take_over
from flows.search.run import run_search
from flows.search.study import REPEAT_OF_ATTR, StudyDesk, make_study

ONE_POINT = {"hidden_size": {"choices": [16]}}  # every ask is the same point
DEFAULTS: dict[str, Any] = SweepParams(epochs=4).trial_defaults()


def one_point_desk(pruner: Any = "asha") -> StudyDesk:
    return StudyDesk(make_study("tpe", pruner, 0, 1, 2, 4), parse_space(ONE_POINT))


def test_a_point_completed_before_is_told_its_value_and_the_first_stays_the_best() -> None:
    desk = one_point_desk()
    first, values = desk.ask()
    for epoch, loss in enumerate([2.0, 1.8, 1.7, 1.6], start=1):
        desk.report(first, epoch, loss, can_prune=epoch < 4)
    desk.tell(first, TrialState.COMPLETE, 1.6)
    again, same = desk.ask()
    assert same == values
    twin = desk.finished_twin(again, same)
    assert twin is not None and twin.number == first.number
    desk.tell_repeat(again, twin)
    told = desk.study.trials[again.number]
    assert (told.state, told.value) == (TrialState.COMPLETE, 1.6)
    assert told.user_attrs[REPEAT_OF_ATTR] == first.number
    assert desk.repeats() == {again.number: first.number}
    assert desk.best() == (first.number, 1.6, values), "the trained trial, not its repeat"


def test_a_point_pruned_before_is_pruned_at_the_same_epoch_with_the_same_loss() -> None:
    desk = one_point_desk()
    first, values = desk.ask()
    desk.report(first, 1, 2.5, can_prune=True)
    desk.tell(first, TrialState.PRUNED)
    again, same = desk.ask()
    twin = desk.finished_twin(again, same)
    assert twin is not None
    desk.tell_repeat(again, twin)
    told = desk.study.trials[again.number]
    assert told.state is TrialState.PRUNED and told.intermediate_values == {1: 2.5}
    rungs = [k for k in told.system_attrs if "rung" in k]
    assert rungs == [], "a rung holds each trained trial once: the pruner is not asked"
    assert desk.best() is None, "nothing completed"


def test_a_running_or_failed_point_is_no_twin() -> None:
    desk = one_point_desk()
    running, values = desk.ask()
    again, same = desk.ask()
    assert desk.finished_twin(again, same) is None, "still training: it may yet fail"
    desk.tell(running, TrialState.FAIL)
    assert desk.finished_twin(again, same) is None, "a crash is no result to repeat"


def test_the_board_counts_a_repeat_as_done_and_spends_no_epochs() -> None:
    board = SearchBoard(n_trials=3, max_epochs=4, budget_epochs=8)
    line = board.repeated()
    assert board.done == 1 and board.spent == 0 and not board.budget_reached()
    assert "1 repeated points" in line and "0 trial-epochs spent" in line, line


def test_a_search_trains_no_repeat_and_counts_it_as_asked(monkeypatch, tmp_path) -> None:
    """run_search over a study that already completed its only point: every trial asked is
    a repeat, so nothing is launched and the search stops after n_trials asks."""
    monkeypatch.setattr(SearchBoard, "open", lambda self: None)  # no Prefect run here
    desk = one_point_desk()
    first, _ = desk.ask()
    desk.tell(first, TrialState.COMPLETE, 1.6)
    setup = SweepSetup(None, RunRef(f"sqlite:///{tmp_path}/m.db", "p"), "e", str(tmp_path), None, 1)

    def launch(*args: Any) -> Any:
        raise AssertionError("a repeat was trained")

    outcomes = run_search(
        desk, DEFAULTS, 4, setup, WorkerSlots(["w1", "w2"]), 1, None, launch, already_done=1
    )
    assert outcomes == []
    assert desk.repeats() == {1: 0, 2: 0, 3: 0}
    assert len(desk.study.trials) == 4, "n_trials counts the repeats"


def test_a_resumed_study_keeps_a_repeat_as_asked_without_an_outcome(tmp_path) -> None:
    desk = one_point_desk()
    first, _ = desk.ask()
    desk.tell(first, TrialState.COMPLETE, 1.6)
    again, same = desk.ask()
    twin = desk.finished_twin(again, same)
    assert twin is not None
    desk.tell_repeat(again, twin)
    resumed = take_over(desk.study)
    assert resumed.done == 2, "both were asked: n_trials counts both"
    kept = kept_outcomes(Resumed(resumed.kept), DEFAULTS, f"sqlite:///{tmp_path}/m.db")
    assert [o.spec.index for o in kept] == [first.number]
    assert kept[0].completed


def test_a_sampler_that_asks_only_trained_points_stops_the_search(monkeypatch, tmp_path) -> None:
    """A space the sampler has covered: asking on would only count repeats up to n_trials
    (1000 with a budget in epochs); the search stops after MAX_REPEATS_IN_A_ROW of them."""
    monkeypatch.setattr(SearchBoard, "open", lambda self: None)
    desk = one_point_desk()
    first, _ = desk.ask()
    desk.tell(first, TrialState.COMPLETE, 1.6)
    setup = SweepSetup(None, RunRef(f"sqlite:///{tmp_path}/m.db", "p"), "e", str(tmp_path), None, 1)
    outcomes = run_search(
        desk,
        DEFAULTS,
        1000,
        setup,
        WorkerSlots(["w1"]),
        1,
        None,
        None,
        already_done=1,  # type: ignore[arg-type]
    )
    assert outcomes == []
    assert len(desk.repeats()) == MAX_REPEATS_IN_A_ROW
