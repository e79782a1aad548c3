"""Resuming a search whose flow process died: what the study kept, what is asked again.

The study (flows.search.storage) holds every trial the first process asked. On a rerun with
the same study name:

- a trial that finished (COMPLETE, PRUNED, FAIL) is kept and not rerun; its outcome is
  rebuilt from the study and its child run (epochs from MLflow), so the ranking, the plots
  and the best trial's registration see the whole study;
- a trial that was RUNNING when the process died is marked FAIL and listed in the study's
  user attribute `ddpflow_interrupted`, its child run ends KILLED with `ddpflow.trial_state`
  INTERRUPTED, and its parameters are enqueued, so the next ask trains them again;
- a trial that repeated an earlier point (told its result, flows.search.run) counts as asked
  and has no outcome of its own: the earlier trial's stands for both;
- the budget counts the finished trials: `n_trials` is the study's total, not this run's,
  and `budget_epochs` counts the kept trials' epochs (`spent_epochs`) as spent.

The new parent run is linked to the one before: tag `ddpflow.resumed_from`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from mlflow.tracking import MlflowClient
from optuna.trial import FrozenTrial, TrialState

from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.sweep.config import CHARLM_FIELDS, TrialFields, validate_trial
from ddpflow.workloads.sweep.execute import TrialOutcome, partial_history
from flows.search.study import REPEAT_OF_ATTR

INTERRUPTED_ATTR = "ddpflow_interrupted"  # the study's: numbers of interrupted trials
REASKED_ATTR = "ddpflow_reasked_from"
RUN_ID_ATTR = "mlflow_run_id"
CHECKPOINT_ATTR = "checkpoint_uri"
PRUNED_AT_ATTR = "pruned_at_epoch"
ERROR_ATTR = "error"
PARENT_ATTR = "mlflow_parent_run_id"  # the study's: the parent run of its latest flow run
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
STUDY_TAG = "ddpflow.study"  # a searched trial's child run: its study's name
TRIAL_TAG = "ddpflow.optuna_trial"  # and its number in the study


@dataclass(frozen=True)
class Resumed:
    """What the study held when this flow run opened it."""

    kept: list[FrozenTrial] = field(default_factory=list)  # finished, not interrupted
    interrupted: list[FrozenTrial] = field(default_factory=list)
    previous_parent: str | None = None

    @property
    def done(self) -> int:
        return len(self.kept)


def take_over(study: optuna.Study) -> Resumed:
    """Mark the trials a dead process left RUNNING as interrupted and enqueue them again."""
    interrupted = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    numbers = [*study.user_attrs.get(INTERRUPTED_ATTR, []), *(t.number for t in interrupted)]
    study.set_user_attr(INTERRUPTED_ATTR, numbers)  # before the tell: a crash here re-does it
    for trial in interrupted:
        study.tell(trial.number, state=TrialState.FAIL)
        study.enqueue_trial(dict(trial.params), user_attrs={REASKED_ATTR: trial.number})
    kept = [t for t in study.get_trials(deepcopy=False, states=FINISHED) if t.number not in numbers]
    parent = study.user_attrs.get(PARENT_ATTR)
    return Resumed(kept, interrupted, str(parent) if parent else None)


def kill_interrupted_runs(
    tracking_uri: str, experiment: str, study_name: str, trials: Sequence[FrozenTrial]
) -> None:
    """End the child runs of interrupted trials KILLED, tagged INTERRUPTED (found by their
    tags: the study's name and the trial's number, set when the run started)."""
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None or not trials:
        return
    for trial in trials:
        where = (
            f"tags.`{STUDY_TAG}` = '{study_name}' and tags.`{TRIAL_TAG}` = '{trial.number}' "
            "and attributes.status = 'RUNNING'"
        )
        for run in client.search_runs([found.experiment_id], where):
            client.set_tag(run.info.run_id, "ddpflow.trial_state", "INTERRUPTED")
            client.set_terminated(run.info.run_id, "KILLED")


def kept_outcomes(
    resumed: Resumed,
    defaults: Mapping[str, Any],
    tracking_uri: str,
    trial_fields: TrialFields = CHARLM_FIELDS,
) -> list[TrialOutcome]:
    """The finished trials of earlier flow runs, as outcomes of this one (no training); a
    repeat has none (its twin's outcome is kept)."""
    outcomes = []
    for trial in resumed.kept:
        attrs: dict[str, Any] = dict(trial.user_attrs)
        if REPEAT_OF_ATTR in attrs:
            continue
        run_id = str(attrs.get(RUN_ID_ATTR, ""))
        history = partial_history(RunRef(tracking_uri, run_id)) if run_id else []
        pruned_at = attrs.get(PRUNED_AT_ATTR)
        outcomes.append(
            TrialOutcome(
                validate_trial(trial.number, {**defaults, **trial.params}, trial_fields),
                run_id,
                completed=trial.state is TrialState.COMPLETE,
                history=history,
                checkpoint_uri=attrs.get(CHECKPOINT_ATTR),
                error=attrs.get(ERROR_ATTR),
                pruned_at=int(pruned_at) if pruned_at is not None else None,
            )
        )
    return outcomes


def spent_epochs(kept: Sequence[TrialOutcome]) -> int:
    """The trial-epochs the kept trials spent (their child runs' epochs): a budget's start."""
    return sum(len(o.history) for o in kept)
