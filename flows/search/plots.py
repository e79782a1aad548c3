"""Optuna's own plots of a search's study, as PNGs for the parent run: the optimisation
history (each completed trial's loss and the best so far) and the parallel coordinates
(each completed trial's values against its loss). Drawn with Optuna's matplotlib backend
(matplotlib: the `plots` extra, which the flows install)."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable
from typing import Any

import optuna

log = logging.getLogger(__name__)
DPI = 100


def study_pngs(study: optuna.Study) -> dict[str, bytes]:
    """PNG bytes by file name; a plot that cannot be drawn (no completed trial) is left out."""
    import matplotlib

    matplotlib.use("Agg")  # a flow has no display; the only backend that never opens one
    from optuna.visualization import matplotlib as plots

    drawn: dict[str, bytes] = {}
    makers: dict[str, Callable[..., Any]] = {
        "optimization_history.png": plots.plot_optimization_history,
        "parallel_coordinate.png": plots.plot_parallel_coordinate,
    }
    for name, make in makers.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                axes = make(study, target_name="validation loss")
            figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
            drawn[name] = buffer.getvalue()
            import matplotlib.pyplot as plt

            plt.close(figure)
        except Exception as error:  # noqa: BLE001 - the plots are a nicety of the report
            log.warning("%s not drawn: %s", name, error)
    return drawn
