"""Run inside a fresh virtual environment that holds the ddpflow wheel and its own
requirements only, no extras (tests/integration/test_house_layout.py makes it and runs these
there). `probe` says what is installed and how each part that needs an extra fails; `main`
trains with the public API as docs/api.md shows it: a LocalCluster of two worker processes,
`ddpflow.run` of a function on `ddpflow.fit`, tracked in a sqlite:/// MLflow store. Each
prints one JSON line of what the test checks.

Only the wheel's requirements may be imported here: no pytest, no tests package, no
checkout. The workers import `train` from this module (PYTHONPATH names its folder), as
they would a user's module.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import distributed
import torch
from torch import nn

import ddpflow
from ddpflow.cluster.build import LOOPBACK_DASHBOARD

NUM_SAMPLES, NUM_FEATURES = 512, 4
EPOCHS = 3
OPTIONAL = ("prefect", "prefect_dask", "optuna", "matplotlib", "sklearn")


def _sweep_plots() -> object:
    return importlib.import_module("ddpflow.workloads.sweep.plots")


def _scaling_plots() -> object:
    return importlib.import_module("ddpflow.workloads.scaling.plots")


def _confusion_png() -> object:
    from ddpflow.workloads.vision.reports import confusion_png

    return confusion_png(["a", "b"], [[1, 0], [0, 1]], "title")


def _digits_pngs() -> object:
    from ddpflow.workloads.vision.digits import digits_pngs

    return digits_pngs()


def _run_in_flow() -> object:
    return ddpflow.run_in_flow


def _dask_task_runner() -> object:
    return ddpflow.dask_task_runner


NEEDS_AN_EXTRA: dict[str, Callable[[], object]] = {
    "sweep plots": _sweep_plots,
    "scaling plots": _scaling_plots,
    "confusion_png": _confusion_png,
    "digits_pngs": _digits_pngs,
    "run_in_flow": _run_in_flow,
    "dask_task_runner": _dask_task_runner,
}


def _failure(call: Callable[[], object]) -> dict[str, str] | None:
    try:
        call()
    except ImportError as error:
        return {"type": type(error).__name__, "message": str(error)}
    return None


def probe() -> None:
    print(
        json.dumps(
            {
                "distributions": sorted(
                    d.metadata["Name"].lower() for d in importlib.metadata.distributions()
                ),
                "importable": [m for m in OPTIONAL if importlib.util.find_spec(m) is not None],
                "failures": {name: _failure(call) for name, call in NEEDS_AN_EXTRA.items()},
            }
        )
    )


def train(ctx: ddpflow.TrainContext, epochs: int) -> list[float]:
    """A linear regression on ddpflow.fit: each epoch's mean training loss."""
    gen = torch.Generator().manual_seed(0)  # the same data on every rank
    x = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=gen)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    y = x @ w + 0.01 * torch.randn(NUM_SAMPLES, 1, generator=gen)
    split = NUM_SAMPLES * 3 // 4
    torch.manual_seed(ctx.seed)  # the same initial weights on every rank
    net = nn.Linear(NUM_FEATURES, 1)
    history = ddpflow.fit(
        ctx,
        model=ctx.wrap(net),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
        train=ddpflow.TensorPairs(x[:split], y[:split]),
        val=ddpflow.TensorPairs(x[split:], y[split:]),
        epochs=epochs,
        batch_size=16,
        hooks=ddpflow.FitHooks(loss=nn.functional.mse_loss),
        log_every_steps=4,
    )
    return [stats.train_loss for stats in history]


def main(folder: Path) -> None:
    from mlflow.tracking import MlflowClient

    tracking_uri = f"sqlite:///{folder / 'mlflow.db'}"
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            host="127.0.0.1",
            # Not None: that still serves HTTP, on 8787 when it is free, where the compose
            # stack's dashboard (tests/compose_stack), running beside this test, publishes.
            dashboard_address=LOOPBACK_DASHBOARD,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        losses = ddpflow.run(
            client,
            train,
            EPOCHS,
            world_size=2,
            checkpoint_dir=str(folder / "checkpoints"),
            tracking_uri=tracking_uri,
            experiment="wheel",
        )
        # What the workers hold after training: none of the extras' packages was loaded.
        worker_modules = client.run(lambda: sorted(sys.modules))
    mlflow = MlflowClient(tracking_uri)
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name("wheel").experiment_id])
    loaded = set(sys.modules).union(*worker_modules.values())
    print(
        json.dumps(
            {
                "ddpflow": ddpflow.__file__,
                "losses": losses,
                "run_status": run.info.status,
                "logged_train_loss": "train_loss" in run.data.metrics,
                "loaded_optional": sorted(m for m in loaded if m.split(".")[0] in OPTIONAL),
            }
        )
    )
