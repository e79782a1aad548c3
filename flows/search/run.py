"""The sweep's search mode: an Optuna study asks trials as workers free up, and prunes them.

Each of `workers // ranks_per_trial` threads loops: take free workers, ask the study for a
trial (in order, under the study's lock), train it on them (its child MLflow run as any
sweep trial's), judge it epoch by epoch (flows.search.referee), tell the study how it
ended, give the workers back, and go again until `n_trials` were asked or, with
`budget_epochs`, until the trial-epochs spent reach it (flows.search.board counts them:
the finished trials', the running ones' so far, a resumed study's kept ones'); whichever
comes first stops the asking, and the trials running then go on to their end. There is no
synchronous rung: a trial the pruner stops frees its workers at once and the next trial
starts there while the others go on.

A point the study asks again (a sampler over choices does) after a trial trained it to its end
or its rung is not trained again: the trial is told the earlier trial's result (study
attribute `ddpflow_repeat_of`), spends no epochs, has no child run and counts as asked. After
MAX_REPEATS_IN_A_ROW such asks in a row (a discrete space the sampler has covered or converged
on) the search asks no more.

A trial ends COMPLETE (trained all its epochs), PRUNED (stopped after the epoch named in
`ddpflow.pruned_at_epoch`) or FAILED (it crashed: the study is told FAIL and the search goes
on); the child run's tag `ddpflow.trial_state` says which.
"""

from __future__ import annotations

import contextvars
import json
import math
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import optuna
from optuna.trial import TrialState

from ddpflow.tracking.loggers import MlflowLogger, RunRef
from ddpflow.tracking.run import log_files
from ddpflow.training.result import TrainResult
from ddpflow.workloads.sweep import SweepSetup, TrialOutcome, WorkerSlots, reject_trial, run_trial
from ddpflow.workloads.sweep.config import validate_trial
from ddpflow.workloads.sweep.pruning import DEFAULT_WAIT_S, Verdicts
from ddpflow.workloads.sweep.report import REPORT_DIR, table_rows
from ddpflow.workloads.sweep.space import SearchSpace, epochs_range
from ddpflow.workloads.sweep.trial import TrialJob
from flows.search.board import MAX_REPEATS_IN_A_ROW, PROGRESS_KEY, SearchBoard
from flows.search.plots import study_pngs
from flows.search.referee import Referee
from flows.search.resume import (
    CHECKPOINT_ATTR,
    ERROR_ATTR,
    PRUNED_AT_ATTR,
    RUN_ID_ATTR,
    STUDY_TAG,
    TRIAL_TAG,
)
from flows.search.study import StudyDesk

TRIAL_STATE_TAG = "ddpflow.trial_state"  # COMPLETE, PRUNED or FAILED
PRUNED_AT_TAG = "ddpflow.pruned_at_epoch"
BEST_PARAMS_TAG = "ddpflow.best_params"
# What the flow's task launches: (trial number, job, workers, verdicts, referee's subscriber).
LaunchFn = Callable[[int, TrialJob, list[str], Verdicts, Any], TrainResult]


def max_epochs(space: SearchSpace, default_epochs: int) -> int:
    """The most epochs a trial of the space may train (the pruners' largest resource)."""
    return epochs_range(space, default_epochs)[1]


def state_of(outcome: TrialOutcome) -> str:
    """COMPLETE, PRUNED or FAILED (Optuna's FAIL, in MLflow's word)."""
    if outcome.pruned_at is not None:
        return "PRUNED"
    return "COMPLETE" if outcome.completed else "FAILED"


def run_search(
    desk: StudyDesk,
    defaults: Mapping[str, Any],
    n_trials: int,
    setup: SweepSetup,
    slots: WorkerSlots,
    ranks_per_trial: int,
    client: Any,
    launch: LaunchFn,
    verdict_wait_s: float = DEFAULT_WAIT_S,
    already_done: int = 0,
    budget_epochs: int | None = None,
    spent_before: int = 0,
    progress_key: str = PROGRESS_KEY,
) -> list[TrialOutcome]:
    """Ask, train, judge and tell trials until the study holds `n_trials` finished ones
    (`already_done` of them from earlier flow runs) or the trial-epochs spent reach
    `budget_epochs` (`spent_before` of them by earlier flow runs), as many at once as the
    slots hold."""
    board = SearchBoard(
        n_trials - already_done,
        max_epochs(desk.space, int(defaults["epochs"])),
        budget_epochs,
        spent_before,
        progress_key,
    )
    board.open()
    asked = already_done
    asked_lock = threading.Lock()
    exhausted = threading.Event()
    sweep_id = uuid.uuid4().hex[:12]

    def next_trial() -> bool:
        nonlocal asked
        with asked_lock:
            if asked >= n_trials or board.budget_reached():
                return False
            if board.sampler_exhausted():
                if not exhausted.is_set():
                    exhausted.set()
                    print(
                        f"search: the sampler asked {MAX_REPEATS_IN_A_ROW} points in a row that "
                        "earlier trials trained: no trial is asked after it"
                    )
                return False
            asked += 1
            return True

    def one(trial: optuna.Trial, values: dict[str, Any], workers: list[str]) -> TrialOutcome | None:
        spec = validate_trial(trial.number, {**defaults, **values}, setup.fields)
        twin = desk.finished_twin(trial, values) if spec.config is not None else None
        if twin is not None and spec.config is not None:  # asked again: nothing trained
            desk.tell_repeat(trial, twin)
            line = board.repeated()
            print(
                f"trial {trial.number} asks trial {twin.number}'s point again "
                f"({spec.config.label()}): told its {twin.state.name} result without "
                f"training; {line}"
            )
            return None
        # Tagged at the start: a resume finds the runs that a dead flow process left RUNNING.
        tags = {**setup.tags, STUDY_TAG: desk.study.study_name, TRIAL_TAG: str(trial.number)}
        trial_setup = replace(setup, tags=tags)
        if spec.config is None:  # a space within the fields' limits samples none; still safe
            outcome = reject_trial(spec, trial_setup)
            _tell(desk, trial, outcome)
            _tag(setup, outcome, trial)
            return outcome
        print(f"{spec.name} ({spec.config.label()}) starts on {', '.join(workers)}")
        verdicts = Verdicts(f"{sweep_id}-{trial.number}", verdict_wait_s)
        referee = Referee(
            desk,
            trial,
            client,
            verdicts,
            spec.config.epochs,
            on_epoch=lambda epoch: board.epoch_done(trial.number, epoch),
        )
        board.started(trial.number)
        try:
            outcome = run_trial(
                spec,
                workers,
                trial_setup,
                lambda job, w: launch(trial.number, job, w, verdicts, referee.subscriber),
            )
        finally:
            referee.close()
        outcome = _judged(outcome, referee.pruned_at)
        _tell(desk, trial, outcome)
        _tag(setup, outcome, trial)
        line = board.ended(trial.number, outcome)
        print(f"{spec.name} {state_of(outcome)}: {_result(outcome)}; {line}")
        return outcome

    def loop() -> list[TrialOutcome]:
        outcomes: list[TrialOutcome] = []
        while True:
            with slots.hold(ranks_per_trial) as workers:
                if not next_trial():
                    return outcomes
                trial, values = desk.ask()
                outcome = one(trial, values, workers)
                if outcome is not None:
                    outcomes.append(outcome)

    num_threads = max(1, min(n_trials, slots.max_concurrent(ranks_per_trial)))
    with ThreadPoolExecutor(num_threads, thread_name_prefix="ddpflow-search") as pool:
        # Each thread sees a copy of the flow's context variables (its Prefect run).
        futures = [pool.submit(contextvars.copy_context().run, loop) for _ in range(num_threads)]
        outcomes = [o for f in futures for o in f.result()]
    return sorted(outcomes, key=lambda o: o.spec.index)


def _judged(outcome: TrialOutcome, pruned_at: int | None) -> TrialOutcome:
    """A trial that the pruner stopped before its last epoch is PRUNED, not COMPLETE: at the
    rung, or at the next epoch's end where its ranks saw the verdict late."""
    if pruned_at is None or not outcome.completed or outcome.spec.config is None:
        return outcome
    if not outcome.history or outcome.history[-1].epoch >= outcome.spec.config.epochs:
        return outcome  # the verdict came too late for its ranks: it trained to the end
    stopped = outcome.history[-1].epoch
    return replace(outcome, completed=False, pruned_at=stopped, checkpoint_uri=None)


def _tell(desk: StudyDesk, trial: optuna.Trial, outcome: TrialOutcome) -> None:
    """The end of the trial, and what a resume needs to rebuild its outcome, to the study."""
    trial.set_user_attr(RUN_ID_ATTR, outcome.run_id)
    if outcome.checkpoint_uri is not None:
        trial.set_user_attr(CHECKPOINT_ATTR, outcome.checkpoint_uri)
    if outcome.pruned_at is not None:
        trial.set_user_attr(PRUNED_AT_ATTR, outcome.pruned_at)
    if outcome.error is not None:
        trial.set_user_attr(ERROR_ATTR, outcome.error[:2000])
    if outcome.pruned_at is not None:
        desk.tell(trial, TrialState.PRUNED)  # Optuna keeps its last reported value
    elif outcome.completed and math.isfinite(outcome.final_val_loss):
        desk.tell(trial, TrialState.COMPLETE, outcome.final_val_loss)
    else:
        desk.tell(trial, TrialState.FAIL)  # crashed, or a diverged (NaN) loss


def _tag(setup: SweepSetup, outcome: TrialOutcome, trial: optuna.Trial) -> None:
    tags = {TRIAL_STATE_TAG: state_of(outcome), TRIAL_TAG: str(trial.number)}
    if outcome.pruned_at is not None:
        tags[PRUNED_AT_TAG] = str(outcome.pruned_at)
    MlflowLogger(RunRef(setup.parent.tracking_uri, outcome.run_id)).set_tags(tags)


def _result(outcome: TrialOutcome) -> str:
    if outcome.pruned_at is not None:
        return (
            f"stopped after epoch {outcome.pruned_at}, val loss {outcome.history[-1].val_loss:.4f}"
        )
    if outcome.completed:
        return f"val loss {outcome.final_val_loss:.4f}"
    return str(outcome.error)


def search_rows(outcomes: Sequence[TrialOutcome]) -> list[dict[str, Any]]:
    """The sweep's table rows (ranked: completed trials by loss) with each trial's state,
    the epochs it trained, where it was pruned and its last validation loss."""
    by_index = {o.spec.index: o for o in outcomes}
    rows = []
    for row in table_rows(outcomes):
        outcome = by_index[row["trial"]]
        last = outcome.history[-1].val_loss if outcome.history else math.nan
        rows.append(
            {
                **row,
                "state": state_of(outcome),
                "epochs_trained": len(outcome.history),
                "pruned_at_epoch": outcome.pruned_at,
                "last_val_loss": round(last, 4) if math.isfinite(last) else None,
            }
        )
    return rows


def log_study(
    parent: RunRef,
    desk: StudyDesk,
    outcomes: Sequence[TrialOutcome],
    budget_epochs: int | None = None,
) -> None:
    """The study in the parent run: best value and params, states, trial-epochs (a resumed
    study's kept trials' too) and the share of the budget they are, the table, the trials
    that repeated an earlier point."""
    logger = MlflowLogger(parent)
    spent = sum(len(o.history) for o in outcomes)
    counts = {s: sum(state_of(o) == s for o in outcomes) for s in ("COMPLETE", "PRUNED", "FAILED")}
    repeats = desk.repeats()
    metrics: dict[str, float] = {
        "trial_epochs": spent,
        **{f"num_trials_{k.lower()}": v for k, v in counts.items()},
        "num_trials_repeated": len(repeats),
    }
    if budget_epochs is not None:
        metrics["budget_used"] = spent / budget_epochs  # above 1: the trials running at the end
    logger.log_metrics(metrics, step=0)
    best = desk.best()
    study = {
        "study_name": desk.study.study_name,
        "sampler": type(desk.study.sampler).__name__,
        "pruner": type(desk.study.pruner).__name__,
        "trial_epochs": spent,
        "budget_epochs": budget_epochs,
        "best": None if best is None else {"number": best[0], "value": best[1], "params": best[2]},
        "trials": search_rows(outcomes),
        # Points asked again: each trial told the result of the earlier one, untrained.
        "repeats": [{"trial": n, "repeat_of": of} for n, of in sorted(repeats.items())],
    }
    files = {"study.json": json.dumps(study, indent=2).encode(), **study_pngs(desk.study)}
    log_files(parent, files, REPORT_DIR)
    if best is not None:
        logger.log_metrics({"best_value": best[1]}, step=0)
        logger.set_tags({BEST_PARAMS_TAG: json.dumps(best[2], sort_keys=True)})
