"""Ray Tune's ASHA over the same char-LM space, for bench.search_vs_grid (`--ray`).

Ray is a bench-only dependency (the `bench` extra), so it is imported here and nowhere else.
Each Tune trial trains in its Ray worker process with the rank function the sweep flow's
trials run (`ddpflow.workloads.charlm.training.train_rank`), as a group of one, into its
own child run of the bench's MLflow store; each epoch's holdout loss goes to Tune from
`on_epoch_end`. Scheduler: `ASHAScheduler` (grace period = the flow's min_epochs, reduction
factor = its eta); searcher: `OptunaSearch` with the flow's own sampler (TPE, constant liar,
the same seed), so the two searches differ in how trials are launched and stopped, not in
what is asked.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RayTrialSetup:
    """What every Ray trial shares (it is pickled to each Ray worker)."""

    train_uri: str
    val_uri: str
    tracking_uri: str
    experiment: str
    parent_run_id: str
    artifact_root: str
    artifact_location: str | None
    epochs: int
    batch_size: int
    dropout: float
    seed: int  # the trials' training seed (initial weights, data order), as the flow's


@dataclass(frozen=True)
class RayPoint:
    """One epoch's holdout loss of one Tune trial, when its rank reported it."""

    trial: str
    epoch: int
    val_loss: float
    at: float  # time.time() in the trial's process, after the epoch's evaluation


@dataclass(frozen=True)
class RayRun:
    points: list[RayPoint]
    first_start: float  # the earliest trial's entry into its training function
    wall_s: float  # ray.init + Tuner.fit, as the bench process saw it
    num_trials: int


def train_trial(config: Mapping[str, Any], setup: RayTrialSetup) -> None:
    """One Tune trial: a child run, its CharLMTrainJob, train_rank in a group of one."""
    started = time.time()
    # Imported in the Ray worker: the driver needs none of it to schedule trials.
    import torch
    from ray import tune

    from ddpflow import storage
    from ddpflow.api import rank_entry
    from ddpflow.distributed import RankSpec
    from ddpflow.distributed.context import find_free_port, process_group
    from ddpflow.tracking.loggers import RunRef
    from ddpflow.tracking.run import end_run, start_run
    from ddpflow.training.context import TrainContext
    from ddpflow.training.result import EpochStats, TrainResult
    from ddpflow.workloads.charlm.config import CharLSTMConfig
    from ddpflow.workloads.charlm.job import CharLMTrainJob
    from ddpflow.workloads.charlm.training import train_rank

    torch.set_num_threads(1)  # as a Dask worker's rank has: 1 core per trial
    trial_id = tune.get_context().get_trial_id()
    values = {k: config[k] for k in ("lr", "hidden_size", "num_layers")}
    run = start_run(
        setup.tracking_uri,
        setup.experiment,
        run_name=f"ray {trial_id}",
        params={**values, "epochs": setup.epochs, "batch_size": setup.batch_size},
        tags={"ddpflow.trial": trial_id},
        artifact_location=setup.artifact_location,
        parent_run_id=setup.parent_run_id,
    )
    job = CharLMTrainJob(
        train_uri=setup.train_uri,
        val_uri=setup.val_uri,
        model=CharLSTMConfig(
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_layers"]),
            dropout=setup.dropout,
        ),
        epochs=setup.epochs,
        batch_size=setup.batch_size,
        lr=float(config["lr"]),
        seed=setup.seed,
        checkpoint_root=storage.join(setup.artifact_root, "runs", run.run_id, "checkpoints"),
        keep_last=1,  # as the sweep's trials keep
        run=RunRef(setup.tracking_uri, run.run_id),
    )

    def report(stats: EpochStats) -> None:
        # Tune's ASHA decides here; a stopped trial's process does not come back from it.
        tune.report(
            {
                "val_loss": stats.val_loss,
                "epoch": stats.epoch,
                "reported_at": time.time(),
                "started_at": started,
            }
        )

    def rank(ctx: TrainContext, trial_job: CharLMTrainJob) -> TrainResult:
        return train_rank(ctx, trial_job, on_epoch_end=report)

    spec = RankSpec(0, 1, "127.0.0.1", find_free_port(), "gloo", TIMEOUT_S, uuid.uuid4().hex)
    with process_group(spec) as rank_ctx:
        rank_entry(rank_ctx, rank, (job,), job.train_settings(), job.run)
    end_run(run)


def run_ray_search(
    setup: RayTrialSetup,
    space: Mapping[str, Sequence[Any]],
    n_trials: int,
    min_epochs: int,
    eta: int,
    seed: int,
    storage_path: Path,
    repo: Path,
) -> RayRun:
    """Tune's ASHA + OptunaSearch over `space` (field -> choices): n_trials trials, 2 at a
    time, 1 CPU each; every reported epoch back, in the trials' own clocks."""
    import optuna
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    started = time.perf_counter()
    # The workers import ddpflow and bench from the checkout, wherever Ray starts them.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(repo)}},
    )
    try:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        searcher = OptunaSearch(
            metric="val_loss",
            mode="min",
            sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True),
        )
        scheduler = ASHAScheduler(
            time_attr="training_iteration",
            max_t=setup.epochs,
            grace_period=min_epochs,
            reduction_factor=eta,
        )
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(train_trial, setup=setup), {"cpu": 1}),
            param_space={k: tune.choice(list(v)) for k, v in space.items()},
            tune_config=tune.TuneConfig(
                metric="val_loss",
                mode="min",
                search_alg=searcher,
                scheduler=scheduler,
                num_samples=n_trials,
                max_concurrent_trials=2,
            ),
            run_config=tune.RunConfig(storage_path=str(storage_path), verbose=0),
        )
        grid = tuner.fit()
        wall_s = time.perf_counter() - started
    finally:
        ray.shutdown()
    points: list[RayPoint] = []
    starts: list[float] = []
    for result in grid:
        if result.error is not None:
            raise RuntimeError(f"a Ray trial failed: {result.error}")
        frame = result.metrics_dataframe
        trial = str(result.metrics.get("trial_id", len(starts)))
        starts.append(float(frame["started_at"].min()))
        points += [
            RayPoint(trial, int(r.epoch), float(r.val_loss), float(r.reported_at))
            for r in frame.itertuples()
        ]
    return RayRun(points, min(starts), wall_s, len(grid))
