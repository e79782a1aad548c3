"""Compare the trials: ranking, the table, the plots, and what goes into the parent run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from ddpflow.tracking.loggers import MlflowLogger, RunRef
from ddpflow.tracking.run import log_files
from ddpflow.workloads.sweep.execute import TrialOutcome
from ddpflow.workloads.sweep.plots import LossCurve, XAxis, loss_panels_png
from ddpflow.workloads.sweep.trial import elapsed_by_epoch

BEST_RUN_TAG = "ddpflow.best_run_id"
BEST_TRIAL_TAG = "ddpflow.best_trial"
PLOT_NAMES: dict[XAxis, str] = {"epoch": "loss_vs_epoch.png", "elapsed_s": "loss_vs_elapsed.png"}
REPORT_DIR = "sweep"


def _rankable(outcome: TrialOutcome) -> bool:
    # A diverged trial (NaN loss) completed but cannot be "best".
    return outcome.completed and math.isfinite(outcome.final_val_loss)


def ranked(outcomes: Sequence[TrialOutcome]) -> list[TrialOutcome]:
    """Completed trials by final validation loss (lowest first), then the rest by index."""
    good = sorted((o for o in outcomes if _rankable(o)), key=lambda o: o.final_val_loss)
    rest = sorted((o for o in outcomes if not _rankable(o)), key=lambda o: o.spec.index)
    return good + rest


def best(outcomes: Sequence[TrialOutcome]) -> TrialOutcome | None:
    order = ranked(outcomes)
    return order[0] if order and _rankable(order[0]) else None


def _round(value: float, digits: int) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def table_rows(outcomes: Sequence[TrialOutcome]) -> list[dict[str, Any]]:
    """One row per trial in ranking order; failed trials have no rank and say why."""
    rows = []
    for position, outcome in enumerate(ranked(outcomes), start=1):
        values = outcome.spec.values
        rows.append(
            {
                "rank": position if _rankable(outcome) else None,
                "trial": outcome.spec.index,
                "status": outcome.status,
                # Failed trials show what was given (e.g. lr=-1), not a corrected value.
                **{k: values.get(k) for k in outcome.spec.field_names},
                "val_loss": _round(outcome.final_val_loss, 4),
                "elapsed_s": _round(outcome.elapsed_s, 1),
                "run_id": outcome.run_id,
                "error": outcome.error or "",
            }
        )
    return rows


def curves(outcomes: Sequence[TrialOutcome]) -> list[LossCurve]:
    """Plot data in trial order, so a panel's position does not depend on its result."""
    result = []
    for outcome in sorted(outcomes, key=lambda o: o.spec.index):
        history = outcome.history
        label = outcome.spec.config.label() if outcome.spec.config else "invalid config"
        note = None if outcome.completed else f"{outcome.status}: {_why(outcome)}"
        result.append(
            LossCurve(
                title=f"{outcome.spec.name}: {label}",
                epochs=[s.epoch for s in history],
                elapsed_s=[e for _, e in elapsed_by_epoch(history)],
                train_loss=[s.train_loss for s in history],
                val_loss=[s.val_loss for s in history],
                note=note,
            )
        )
    return result


def _why(outcome: TrialOutcome) -> str:
    if outcome.pruned_at is not None:
        return f"stopped by the pruner after epoch {outcome.pruned_at}"
    return str(outcome.error)


def plots(outcomes: Sequence[TrialOutcome]) -> dict[str, bytes]:
    """PNG bytes by file name: loss vs epoch and loss vs elapsed seconds."""
    data = curves(outcomes)
    return {name: loss_panels_png(data, x) for x, name in PLOT_NAMES.items()}


def log_to_parent(parent: RunRef, outcomes: Sequence[TrialOutcome], pngs: dict[str, bytes]) -> None:
    """Plots, the ranking as JSON, counts and the best trial go into the sweep's parent run."""
    files = {**pngs, "trials.json": json.dumps(table_rows(outcomes), indent=2).encode()}
    log_files(parent, files, REPORT_DIR)
    logger = MlflowLogger(parent)
    num_completed = sum(o.completed for o in outcomes)
    num_pruned = sum(o.pruned_at is not None for o in outcomes)
    metrics: dict[str, float] = {
        "num_trials_completed": num_completed,
        "num_trials_failed": len(outcomes) - num_completed - num_pruned,
    }
    if num_pruned:
        metrics["num_trials_pruned"] = num_pruned
    top = best(outcomes)
    if top is not None:
        metrics["best_val_loss"] = top.final_val_loss
        logger.set_tags({BEST_RUN_TAG: top.run_id, BEST_TRIAL_TAG: str(top.spec.index)})
    logger.log_metrics(metrics, step=0)
