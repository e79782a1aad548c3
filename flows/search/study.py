"""The sweep's Optuna study: its sampler, its pruner, and a trial's values from the space.

Optuna runs in the flow process only (ask/tell): the trials' ranks never import it. The
sampler is seeded by the sweep's `seed`, so the same seed asks the same first trials. The
grid sampler is Optuna's `GridSampler` over the space's grid points (space.grid_of), each
asked once, in an order the seed shuffles.
The pruners are Optuna's own: ASHA is `SuccessiveHalvingPruner` (rungs at epochs r, r·η,
r·η², ... with r = min_epochs), Hyperband is `HyperbandPruner` over the same r and η.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Literal

import optuna

from ddpflow.workloads.sweep.space import Choices, SearchSpace, grid_of

SamplerName = Literal["tpe", "random", "grid"]
REPEAT_OF_ATTR = "ddpflow_repeat_of"  # a trial told an earlier trial's result: its number
PrunerName = Literal["asha", "hyperband", "none"]


_TRAINED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's GridSampler, asked and told outside `study.optimize`: its `after_trial` stops
    the optimize loop once every point was asked, which outside that loop raises. The search
    stops asking by itself (flows.search.run: n_trials is the grid's size)."""

    def after_trial(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        state: optuna.trial.TrialState,
        values: Any,
    ) -> None:
        return None


def make_sampler(
    name: SamplerName, seed: int, space: SearchSpace | None = None
) -> optuna.samplers.BaseSampler:
    if name == "grid":
        if space is None:
            raise ValueError("sampler='grid' needs the search space")
        return AskTellGridSampler(grid_of(space), seed=seed)
    if name == "tpe":
        # constant_liar: trials still running count as bad guesses, so concurrent asks
        # spread out instead of piling onto the same point.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler={name!r}: use tpe, random or grid")


def make_pruner(
    name: PrunerName, min_epochs: int, eta: int, max_epochs: int
) -> optuna.pruners.BasePruner:
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_epochs, reduction_factor=eta)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=min_epochs, max_resource=max_epochs, reduction_factor=eta
        )
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"pruner={name!r}: use asha, hyperband or none")


def make_study(
    sampler: SamplerName,
    pruner: PrunerName,
    seed: int,
    min_epochs: int,
    eta: int,
    max_epochs: int,
    study_name: str | None = None,
    storage: optuna.storages.BaseStorage | None = None,
    space: SearchSpace | None = None,
) -> optuna.Study:
    """A study that minimises the validation loss: new, or the one of that name in `storage`
    (flows.search.storage), resumed. A resumed study's sampler (but the grid's, which skips
    the points asked) is seeded with the seed plus the trials it holds, so it does not ask
    the first trials' values again."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the flow prints its own lines
    study = optuna.create_study(
        direction="minimize",
        sampler=make_sampler(sampler, seed, space),
        pruner=make_pruner(pruner, min_epochs, eta, max_epochs),
        study_name=study_name,
        storage=storage,
        load_if_exists=True,
    )
    held = len(study.get_trials(deepcopy=False))
    # Not the grid's: its points are numbered in its seeded order, so a resumed study needs
    # the same order to know which points were asked.
    if held and sampler != "grid":
        study.sampler = make_sampler(sampler, seed + held, space)
    return study


def suggest(trial: optuna.Trial, space: SearchSpace) -> dict[str, Any]:
    """The trial's values of the space's fields, sampled by the study's sampler."""
    values: dict[str, Any] = {}
    for d in space.dimensions:
        if isinstance(d, Choices):
            values[d.name] = trial.suggest_categorical(d.name, list(d.values))
        elif d.kind is int:
            step = int(d.step) if d.step is not None else 1
            values[d.name] = trial.suggest_int(
                d.name, int(d.low), int(d.high), step=step, log=d.log
            )
        else:
            values[d.name] = trial.suggest_float(d.name, d.low, d.high, step=d.step, log=d.log)
    return values


class StudyDesk:
    """The study behind one lock: the trial threads ask, report and tell through it, so the
    asks happen one at a time, in order (the same seed gives the same first trials)."""

    def __init__(self, study: optuna.Study, space: SearchSpace):
        self.study, self.space = study, space
        self._lock = threading.Lock()

    def ask(self) -> tuple[optuna.Trial, dict[str, Any]]:
        with self._lock:
            trial = self.study.ask()
            return trial, suggest(trial, self.space)

    def report(self, trial: optuna.Trial, epoch: int, value: float, can_prune: bool) -> bool:
        """Report the epoch's loss; whether the pruner stops the trial here."""
        with self._lock:
            trial.report(value, epoch)
            return can_prune and trial.should_prune()

    def tell(
        self, trial: optuna.Trial, state: optuna.trial.TrialState, value: float | None = None
    ) -> None:
        with self._lock:
            self.study.tell(trial, value, state=state)

    def finished_twin(
        self, trial: optuna.Trial, values: Mapping[str, Any]
    ) -> optuna.trial.FrozenTrial | None:
        """The first trial that trained these values to its end or its rung (COMPLETE or
        PRUNED), if any: a sampler over choices asks a point again, and training it again
        would spend its epochs on the same losses (the trials train with one seed)."""
        with self._lock:
            for earlier in self.study.get_trials(deepcopy=False, states=_TRAINED):
                original = REPEAT_OF_ATTR not in earlier.user_attrs
                if original and earlier.number != trial.number and earlier.params == values:
                    return earlier
            return None

    def tell_repeat(self, trial: optuna.Trial, twin: optuna.trial.FrozenTrial) -> None:
        """End `trial` as its twin ended, without training: COMPLETE with the twin's value,
        or PRUNED at the twin's last reported epoch. Its epochs are not reported to the pruner
        (its rungs already hold the twin's), only to the trial, so the sampler sees it."""
        with self._lock:
            trial.set_user_attr(REPEAT_OF_ATTR, twin.number)
            if twin.state is optuna.trial.TrialState.COMPLETE:
                self.study.tell(trial, twin.value, state=optuna.trial.TrialState.COMPLETE)
                return
            for epoch, value in sorted(twin.intermediate_values.items()):
                trial.report(value, epoch)
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    def repeats(self) -> dict[int, int]:
        """Trial number -> the number of the earlier trial whose result it was told."""
        with self._lock:
            return {
                t.number: int(t.user_attrs[REPEAT_OF_ATTR])
                for t in self.study.get_trials(deepcopy=False)
                if REPEAT_OF_ATTR in t.user_attrs
            }

    def best(self) -> tuple[int, float, Mapping[str, Any]] | None:
        """(trial number, value, params) of the best completed trial that trained (a repeat
        told its twin's value is not a model), the first of equals; or None."""
        with self._lock:
            done = [
                t
                for t in self.study.get_trials(
                    deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)
                )
                if REPEAT_OF_ATTR not in t.user_attrs and t.value is not None
            ]
            if not done:
                return None
            top = min(done, key=lambda t: (t.value, t.number))
            assert top.value is not None
            return top.number, top.value, dict(top.params)
