"""What a sweep prints at the end: the ranking, the best trial and where to look next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COLUMNS = (
    ("rank", 4),
    ("trial", 5),
    ("status", 9),
    ("batch_size", 10),
    ("lr", 8),
    ("hidden_size", 11),
    ("num_layers", 10),
    ("epochs", 6),
    ("val_loss", 8),
    ("elapsed_s", 9),
    ("run_id", 32),
)
# An image sweep's table: its trial fields in place of the pet-name model's.
IMAGE_COLUMNS = (
    ("rank", 4),
    ("trial", 5),
    ("status", 9),
    ("batch_size", 10),
    ("lr", 8),
    ("freeze_backbone", 15),
    ("augment", 7),
    ("epochs", 6),
    ("val_loss", 8),
    ("elapsed_s", 9),
    ("run_id", 32),
)


@dataclass(frozen=True)
class SweepSummary:
    parent_run_id: str
    rows: list[dict[str, Any]]
    num_completed: int
    best_run_id: str | None
    best_val_loss: float | None
    model_name: str
    model_version: str | None
    promotion: str | None
    promoted: bool
    table_key: str
    columns: tuple[tuple[str, int], ...] = COLUMNS

    def render(self, ui_hint: str) -> str:
        return "\n".join(
            [
                "",
                f"ddpflow: sweep finished, {self.num_completed} of {len(self.rows)} trials "
                "completed",
                f"  MLflow parent run  {self.parent_run_id}",
                "",
                *("  " + line for line in table_lines(self.rows, self.columns)),
                "",
                *self._result_lines(),
                "  plots              sweep/loss_vs_epoch.png, sweep/loss_vs_elapsed.png "
                "(parent run artifacts)",
                f"  Prefect artifact   {self.table_key}",
                f"  MLflow UI          {ui_hint}",
                "",
            ]
        )

    def _result_lines(self) -> list[str]:
        if self.best_run_id is None:
            return ["  best trial         none (no trial completed)"]
        lines = [
            f"  best trial         run {self.best_run_id}, val loss {self.best_val_loss:.4f}",
            f"  registered model   {self.model_name} version {self.model_version}",
        ]
        if self.promotion is not None:
            verdict = "promoted to champion" if self.promoted else "not promoted"
            lines.append(f"  champion           {verdict}: {self.promotion}")
        return lines


def table_lines(
    rows: list[dict[str, Any]], columns: tuple[tuple[str, int], ...] = COLUMNS
) -> list[str]:
    """A fixed-width text table; failed trials get their error on the next line."""
    header = " ".join(name.ljust(width) for name, width in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = [_cell(row.get(name)).ljust(width) for name, width in columns]
        lines.append(" ".join(cells).rstrip())
        if row.get("error"):
            lines.append(f"      error: {row['error']}")
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
