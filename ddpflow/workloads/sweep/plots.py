"""A sweep's trials compared in pictures: loss vs epoch and vs elapsed seconds, a panel per trial.

The same comparison that Saturn Cloud's tutorial on training many models concurrently draws.

Built on `matplotlib.figure.Figure` directly, not pyplot: no global figure state and no GUI
backend, so it is safe in the flow's threads and on machines without a display (Agg).
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ddpflow.cluster.extras import missing_extra

try:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
except ImportError as error:  # matplotlib is the `plots` extra, not a library requirement
    raise missing_extra("plots", "ddpflow.workloads.sweep.plots", error) from None

XAxis = Literal["epoch", "elapsed_s"]
X_LABELS: dict[str, str] = {"epoch": "epoch", "elapsed_s": "elapsed training seconds"}
MAX_COLUMNS = 4
PANEL_INCHES = (3.6, 2.8)


@dataclass(frozen=True)
class LossCurve:
    """One trial's per-epoch losses; `note` replaces the curves of a trial that failed."""

    title: str
    epochs: list[int]
    elapsed_s: list[float]
    train_loss: list[float]
    val_loss: list[float]
    note: str | None = None


def loss_panels_png(curves: Sequence[LossCurve], x: XAxis, dpi: int = 100) -> bytes:
    """A PNG with one panel per trial (wrapped at 4 columns), losses on a shared y axis."""
    if not curves:
        raise ValueError("no trials to plot")
    num_cols = min(MAX_COLUMNS, len(curves))
    num_rows = math.ceil(len(curves) / num_cols)
    figure = Figure(
        figsize=(PANEL_INCHES[0] * num_cols, PANEL_INCHES[1] * num_rows + 0.6),
        layout="constrained",
    )
    # Shared axes, as in the tutorial's seaborn relplot: panels compare at a glance.
    grid = figure.subplots(num_rows, num_cols, sharex=True, sharey=True, squeeze=False)
    axes = list(grid.flat)
    for ax, curve in zip(axes, curves, strict=False):
        _draw_panel(ax, curve, x)
    for ax in axes[len(curves) :]:
        ax.set_visible(False)
    if x == "elapsed_s":
        axes[0].set_xlim(left=0)  # time starts at 0 for every trial
    figure.suptitle(f"loss vs {X_LABELS[x]}, one panel per trial")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _draw_panel(ax: Axes, curve: LossCurve, x: XAxis) -> None:
    ax.set_title(curve.title, fontsize=9)
    ax.set_xlabel(X_LABELS[x], fontsize=8)
    ax.set_ylabel("loss", fontsize=8)
    # Shared x axes hide the tick labels of upper rows; a panel above an empty slot needs them.
    ax.tick_params(labelsize=7, labelbottom=True)
    ax.grid(alpha=0.3)
    xs = curve.epochs if x == "epoch" else curve.elapsed_s
    if xs:
        ax.plot(xs, curve.train_loss, marker="o", markersize=3, label="train")
        ax.plot(xs, curve.val_loss, marker="s", markersize=3, label="validation")
        ax.legend(fontsize=7)
    if curve.note:
        wrapped = "\n".join(textwrap.wrap(curve.note, 40)[:6])
        ax.text(
            0.5,
            0.5,
            wrapped,
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=7,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "tab:red"},
        )
