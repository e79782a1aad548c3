"""The grid sampler of a search: the space's discrete points, each asked once; a continuous
range refused before the flow starts (no cluster, no trial)."""

from __future__ import annotations

import itertools
import warnings

import optuna
import pytest

from ddpflow.workloads.sweep.config import MAX_TRIALS
from ddpflow.workloads.sweep.space import grid_of, grid_points, parse_space
from flows.params import ImageSweepParams, ParameterError, SweepParams, validate_params
from flows.search.study import StudyDesk, make_study

GRID_SPACE = {
    "lr": {"choices": [0.001, 0.01]},
    "dropout": {"low": 0.0, "high": 0.3, "step": 0.1},
    "num_layers": {"low": 1, "high": 2},
}
POINTS = 2 * 4 * 2


def test_the_grid_points_of_choices_integer_ranges_and_stepped_float_ranges() -> None:
    space = parse_space({**GRID_SPACE, "batch_size": {"low": 8, "high": 20, "step": 4}})
    assert grid_of(space) == {
        "lr": [0.001, 0.01],
        # Decimal steps: 0.3, not 0.30000000000000004, which Optuna's distribution refuses.
        "dropout": [0.0, 0.1, 0.2, 0.3],
        "num_layers": [1, 2],
        "batch_size": [8, 12, 16, 20],
    }
    (lr,) = parse_space({"lr": {"low": 0.001, "high": 0.1}}).dimensions
    assert grid_points(lr) is None, "a continuous range has no grid"


def test_the_grid_sampler_asks_every_point_once_even_with_trials_running() -> None:
    space = parse_space(GRID_SPACE)
    desk = StudyDesk(make_study("grid", "asha", 0, 1, 2, 4, space=space), space)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warns of a point outside its distribution
        # All asked before any is told: the concurrent trials of a search.
        asked = [desk.ask() for _ in range(POINTS)]
        for trial, _ in asked:  # telling the last point must not stop an optimize loop
            desk.tell(trial, optuna.trial.TrialState.COMPLETE, 1.0)
    seen = sorted(tuple(sorted(values.items())) for _, values in asked)
    every = sorted(
        (("dropout", d), ("lr", lr), ("num_layers", n))
        for lr, d, n in itertools.product([0.001, 0.01], [0.0, 0.1, 0.2, 0.3], [1, 2])
    )
    assert seen == every


def test_a_resumed_grid_asks_only_the_points_not_yet_asked() -> None:
    space = parse_space(GRID_SPACE)
    storage = optuna.storages.InMemoryStorage()
    first = StudyDesk(make_study("grid", "none", 3, 1, 2, 4, "g", storage, space), space)
    done = [first.ask() for _ in range(5)]
    for trial, _ in done:
        first.tell(trial, optuna.trial.TrialState.COMPLETE, 1.0)
    again = StudyDesk(make_study("grid", "none", 3, 1, 2, 4, "g", storage, space), space)
    rest = [again.ask()[1] for _ in range(POINTS - 5)]
    seen = [tuple(sorted(v.items())) for v in [*(v for _, v in done), *rest]]
    assert len(set(seen)) == POINTS


def test_without_n_trials_the_grid_sampler_runs_every_point() -> None:
    params = SweepParams(search=GRID_SPACE, sampler="grid")
    assert params.n_trials is None and params.trials_to_ask() == POINTS
    assert SweepParams(search=GRID_SPACE, sampler="grid", n_trials=3).trials_to_ask() == 3
    images = ImageSweepParams(
        search={"freeze_backbone": {"choices": [True, False]}, "lr": {"choices": [0.1, 0.01]}},
        sampler="grid",
    )
    assert images.trials_to_ask() == 4


@pytest.mark.parametrize(
    ("search", "extra", "message"),
    [
        (
            {"lr": {"low": 0.001, "high": 0.1, "log": True}},
            {},
            'search.lr: a continuous range has no grid points; give it a "step"',
        ),
        (
            {"dropout": {"low": 0.0, "high": 0.5}, "lr": {"choices": [0.1]}},
            {},
            'search.dropout: a continuous range has no grid points; give it a "step"',
        ),
        (GRID_SPACE, {"n_trials": POINTS + 1}, f"the grid has {POINTS} points"),
        ({"seed": {"low": 0, "high": 10**6}}, {}, f"the grid has at most {MAX_TRIALS}"),
    ],
)
def test_a_grid_the_sampler_cannot_run_is_refused_naming_the_field(
    search: dict, extra: dict, message: str
) -> None:
    with pytest.raises(ParameterError) as refused:
        validate_params(SweepParams, {"search": search, "sampler": "grid", **extra})
    assert message in str(refused.value)
    assert "sampler grid" in str(refused.value)


def test_a_continuous_range_stays_fine_for_the_other_samplers() -> None:
    for sampler in ("tpe", "random"):
        validate_params(
            SweepParams, {"search": {"lr": {"low": 0.001, "high": 0.1}}, "sampler": sampler}
        )
