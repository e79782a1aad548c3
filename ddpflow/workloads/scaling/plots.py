"""Scaling in pictures: samples/s against world size beside linear, and the efficiency.

Built on `matplotlib.figure.Figure` directly, as the sweep's plots are: no pyplot global
state and no GUI backend, so it is safe in the flow's threads and on headless machines.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from ddpflow.cluster.extras import missing_extra

try:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
except ImportError as error:  # matplotlib is the `plots` extra, not a library requirement
    raise missing_extra("plots", "ddpflow.workloads.scaling.plots", error) from None

PLOT_NAMES = {
    "throughput": "samples_per_s_vs_world_size.png",
    "efficiency": "efficiency_vs_world_size.png",
}


def _completed(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["world_size"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _png(figure: Figure, dpi: int) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9)


def throughput_png(rows: Sequence[dict[str, Any]], title: str, dpi: int = 100) -> bytes:
    """Measured samples/s per world size, and the linear line N x samples/s(1) when size 1
    completed in this run."""
    figure = Figure(figsize=(5, 3.6), layout="constrained")
    ax = figure.subplots()
    sizes, rates = _completed(rows, "samples_per_s")
    baseline = dict(zip(sizes, rates, strict=True)).get(1)
    if sizes:
        ax.plot(sizes, rates, marker="o", label="measured")
        if baseline is not None:
            ax.plot(sizes, [n * baseline for n in sizes], linestyle="--", label="linear")
        ax.set_ylim(bottom=0)  # a ratio read off the picture needs the zero
        ax.legend(fontsize=8)
    else:
        _note(ax, "no world size completed")
    return _finish(figure, ax, rows, "samples/s (steady)", title, dpi)


def efficiency_png(rows: Sequence[dict[str, Any]], title: str, dpi: int = 100) -> bytes:
    """samples/s(N) / (N x samples/s(1)) per world size; 1.0 is linear scaling."""
    figure = Figure(figsize=(5, 3.6), layout="constrained")
    ax = figure.subplots()
    sizes, values = _completed(rows, "efficiency")
    if sizes:
        ax.plot(sizes, values, marker="o", label="measured")
        ax.axhline(1.0, linestyle="--", color="gray", label="linear")
        ax.set_ylim(bottom=0, top=max(1.1, *values) * 1.05)
        ax.legend(fontsize=8)
    else:
        _note(ax, "no efficiency: world size 1 did not complete in this run")
    return _finish(figure, ax, rows, "efficiency against linear", title, dpi)


def _finish(
    figure: Figure, ax: Any, rows: Sequence[dict[str, Any]], ylabel: str, title: str, dpi: int
) -> bytes:
    """What both plots share: a tick per world size in the run, labels, grid, PNG bytes."""
    ax.set_xticks(sorted({r["world_size"] for r in rows}))
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return _png(figure, dpi)


def scaling_plots(rows: Sequence[dict[str, Any]], workload: str) -> dict[str, bytes]:
    """PNG bytes by file name, for the parent run."""
    return {
        PLOT_NAMES["throughput"]: throughput_png(rows, f"{workload}: samples/s vs world size"),
        PLOT_NAMES["efficiency"]: efficiency_png(rows, f"{workload}: efficiency vs world size"),
    }
