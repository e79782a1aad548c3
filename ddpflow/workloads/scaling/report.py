"""One row per world size: steady samples/s, efficiency against linear, time to a target.

Every figure comes from the per-epoch statistics fit() returns (the same ones it logs as
`epoch_samples_per_s` and `epoch_time_s`), so the table matches the child runs' metrics.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpflow.training.result import EpochStats
from ddpflow.workloads.sweep.trial import elapsed_by_epoch

NOT_REACHED = "not reached"
COLUMNS = (
    "world_size",
    "status",
    "samples_per_s",
    "efficiency",
    "wall_s",
    "time_to_target_s",
    "final_metric",
    "run_id",
    "error",
)


@dataclass(frozen=True)
class Target:
    """A validation metric to reach, e.g. val_loss <= 2.0 or val_accuracy >= 0.9."""

    metric: str  # "val_loss" or a key of EpochStats.val_metrics
    value: float | None  # None: no target, the column stays empty
    higher_is_better: bool = False

    def value_of(self, stats: EpochStats) -> float:
        if self.metric == "val_loss":
            return stats.val_loss
        return stats.val_metrics.get(self.metric, math.nan)

    def reached(self, stats: EpochStats) -> bool:
        value = self.value_of(stats)
        if self.value is None or not math.isfinite(value):
            return False
        return value >= self.value if self.higher_is_better else value <= self.value

    def label(self) -> str:
        if self.value is None:
            return "no target"
        return f"{self.metric} {'>=' if self.higher_is_better else '<='} {self.value:g}"


@dataclass(frozen=True)
class SizeResult:
    """What one world size's training gave; a failed size keeps its error and no history."""

    world_size: int
    run_id: str
    completed: bool
    history: list[EpochStats] = field(default_factory=list)
    wall_s: float = math.nan  # the training call as the flow saw it: launch to last rank
    error: str | None = None


def steady_samples_per_s(history: Sequence[EpochStats]) -> float:
    """Samples per second over every epoch but the first (the first alone when there is no
    other), never over an epoch a restart cut into.

    The first epoch pays for warm-up (allocator, caches, the first collectives), which
    would bias the small world sizes, whose epochs are longest, least. An epoch resumed from
    a checkpoint inside it pays that warm-up again over part of an epoch (its figures count
    the steps since the resume: EpochStats.resumed_at_step), so it is left out too. The rate
    is total samples over total training seconds, so a short epoch does not weigh as much as
    a long one. Both come from all ranks together: fit() all-reduces the sample count.
    """
    whole = [s for s in history if s.resumed_at_step is None]
    epochs = whole[1:] if whole[:1] == list(history[:1]) else whole
    epochs = epochs or whole
    seconds = sum(s.epoch_time_s for s in epochs)
    if not epochs or seconds <= 0:
        return math.nan
    return sum(s.samples_per_s * s.epoch_time_s for s in epochs) / seconds


def time_to_target(history: Sequence[EpochStats], target: Target) -> float | None:
    """Training seconds (validation and checkpoints excluded) up to the end of the first
    epoch that reached the target; None if none did. Epoch resolution: validation runs
    once per epoch."""
    for stats, (_, elapsed) in zip(history, elapsed_by_epoch(history), strict=True):
        if target.reached(stats):
            return elapsed
    return None


def efficiency(samples_per_s: float, world_size: int, baseline: float | None) -> float | None:
    """samples/s(N) / (N x samples/s(1)): 1.0 is linear scaling, 0.5 half of it."""
    if baseline is None or not math.isfinite(baseline) or baseline <= 0:
        return None
    if not math.isfinite(samples_per_s):
        return None
    return samples_per_s / (world_size * baseline)


def _round(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None and math.isfinite(value) else None


def table_rows(results: Sequence[SizeResult], target: Target) -> list[dict[str, Any]]:
    """One row per size, smallest first; efficiency only when size 1 completed in this run."""
    ordered = sorted(results, key=lambda r: r.world_size)
    one = next((r for r in ordered if r.world_size == 1 and r.completed), None)
    baseline = steady_samples_per_s(one.history) if one else None
    rows = []
    for result in ordered:
        rate = steady_samples_per_s(result.history) if result.completed else math.nan
        if target.value is None or not result.completed:
            reached: float | str | None = None
        else:
            seconds = time_to_target(result.history, target)
            reached = NOT_REACHED if seconds is None else round(seconds, 2)
        final = (
            target.value_of(result.history[-1]) if result.completed and result.history else math.nan
        )
        rows.append(
            {
                "world_size": result.world_size,
                "status": "completed" if result.completed else "failed",
                "samples_per_s": _round(rate, 1),
                "efficiency": _round(efficiency(rate, result.world_size, baseline), 3),
                "wall_s": _round(result.wall_s, 1),
                "time_to_target_s": reached,
                "final_metric": _round(final, 4),
                "run_id": result.run_id,
                "error": result.error or "",
            }
        )
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown_table(rows: Sequence[dict[str, Any]], target: Target) -> str:
    """The rows as a markdown table; `final_metric` and the target column say which metric."""
    names = {"final_metric": f"final {target.metric}", "time_to_target_s": f"s to {target.label()}"}
    header = [names.get(c, c) for c in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row.get(c)).replace("|", "/") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: "" if row.get(c) is None else row[c] for c in COLUMNS})
    return buffer.getvalue()
