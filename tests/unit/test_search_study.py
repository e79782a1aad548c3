"""The sweep's Optuna study on the ask side: seeded samplers, values of the space's types,
Optuna's own pruners, and the search's flow parameters (no cluster, no trial)."""

from __future__ import annotations

from typing import Any

import optuna
import pytest

from ddpflow.workloads.sweep.space import parse_space
from flows.params import ParameterError, SweepParams, validate_params
from flows.search.study import StudyDesk, make_pruner, make_study

SPACE = {
    "lr": {"low": 1e-4, "high": 1e-1, "log": True},
    "hidden_size": {"choices": [16, 32, 64]},
    "num_layers": {"low": 1, "high": 2},
    "dropout": {"low": 0.0, "high": 0.5, "step": 0.1},
}


def first_asks(sampler: Any, seed: int, n: int = 4) -> list[dict[str, Any]]:
    desk = StudyDesk(make_study(sampler, "asha", seed, 1, 3, 4), parse_space(SPACE))
    return [desk.ask()[1] for _ in range(n)]


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_the_same_seed_asks_the_same_first_trials(sampler: str) -> None:
    assert first_asks(sampler, 7) == first_asks(sampler, 7)
    assert first_asks(sampler, 7) != first_asks(sampler, 8)


def test_asked_values_have_the_fields_types_and_stay_in_the_space() -> None:
    for values in first_asks("tpe", 0, 8):
        assert 1e-4 <= values["lr"] <= 1e-1 and isinstance(values["lr"], float)
        assert values["hidden_size"] in (16, 32, 64)
        assert values["num_layers"] in (1, 2) and isinstance(values["num_layers"], int)
        assert round(values["dropout"] * 10, 6) == int(round(values["dropout"] * 10))


def test_the_pruners_are_optunas() -> None:
    asha = make_pruner("asha", 1, 2, 4)
    assert isinstance(asha, optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(make_pruner("hyperband", 1, 3, 9), optuna.pruners.HyperbandPruner)
    assert isinstance(make_pruner("none", 1, 3, 9), optuna.pruners.NopPruner)


def test_asha_prunes_a_worse_trial_at_its_rung_and_keeps_a_better_one() -> None:
    desk = StudyDesk(make_study("random", "asha", 0, 1, 2, 4), parse_space(SPACE))
    first, _ = desk.ask()
    assert not desk.report(first, 1, 1.0, can_prune=True)  # alone at the rung: promoted
    worse, _ = desk.ask()
    assert desk.report(worse, 1, 2.0, can_prune=True)
    better, _ = desk.ask()
    assert not desk.report(better, 1, 0.5, can_prune=True)
    last, _ = desk.ask()
    assert not desk.report(last, 1, 9.0, can_prune=False), "a last epoch is never pruned"


def test_the_best_trial_is_the_lowest_completed_one() -> None:
    desk = StudyDesk(make_study("random", "none", 0, 1, 2, 4), parse_space(SPACE))
    assert desk.best() is None
    a, _ = desk.ask()
    b, b_values = desk.ask()
    c, _ = desk.ask()
    desk.tell(a, optuna.trial.TrialState.COMPLETE, 1.5)
    desk.tell(b, optuna.trial.TrialState.COMPLETE, 1.2)
    desk.tell(c, optuna.trial.TrialState.FAIL)
    assert desk.best() == (b.number, 1.2, b_values)


def test_a_search_takes_its_flags() -> None:
    params = SweepParams(search=SPACE, sampler="random", n_trials=6, pruner="hyperband", eta=2)
    assert (params.sampler, params.n_trials, params.pruner, params.eta) == (
        "random",
        6,
        "hyperband",
        2,
    )
    assert SweepParams().pruner == "asha" and SweepParams().sampler == "tpe"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"search": {"lr": {"low": -1, "high": 1}}}, "search.lr.low=-1: must be > 0"),
        ({"search": {"width": {"choices": [1]}}}, "search.width: unknown field"),
        ({"search": SPACE, "grid": {"lr": [0.1]}}, "pass one of grid, trials or search"),
        ({"search": SPACE, "pruner": "median"}, "pruner='median'"),
        ({"search": SPACE, "sampler": "bayes"}, "sampler='bayes'"),
        # The grid sampler takes discrete dimensions only: SPACE's lr is a continuous range.
        ({"search": SPACE, "sampler": "grid"}, "search.lr: a continuous range has no grid"),
        ({"search": SPACE, "eta": 1}, "eta=1"),
    ],
)
def test_an_invalid_search_is_refused_before_the_flow_runs(values: dict, message: str) -> None:
    with pytest.raises(ParameterError) as refused:
        validate_params(SweepParams, values)
    assert message in str(refused.value)


def test_the_studys_own_plots_are_pngs() -> None:
    from flows.search.plots import study_pngs

    desk = StudyDesk(make_study("random", "none", 0, 1, 2, 4), parse_space(SPACE))
    for loss in (2.0, 1.5, 1.8):
        trial, _ = desk.ask()
        desk.tell(trial, optuna.trial.TrialState.COMPLETE, loss)
    pngs = study_pngs(desk.study)
    assert sorted(pngs) == ["optimization_history.png", "parallel_coordinate.png"]
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in pngs.values())
