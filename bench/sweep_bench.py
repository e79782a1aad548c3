"""Sweep benchmark: N trials on a LocalCluster vs the same trials one after another.

    .venv/bin/python -m bench.sweep_bench [--trials 4] [--epochs 2] [--hidden-size 32]

Both modes run the sweep's own code path (`ddpflow.workloads.sweep.run_trial`, MLflow child runs,
checkpoints) on the same formatted corpus; only the launch differs. On the cluster each
trial is one rank pinned to a worker (1 torch thread per worker, trials side by side); the
baseline trains each trial in this one process with torch's default thread count. Cluster
start-up and the workers' first imports are timed apart: a long-lived cluster pays them once.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import distributed
import torch

from bench.common import command_line
from ddpflow.api import rank_entry
from ddpflow.cluster.build import local_cluster
from ddpflow.distributed import RankSpec, cluster_workers, launch
from ddpflow.distributed.context import find_free_port, process_group
from ddpflow.tracking.run import default_artifact_location, start_run
from ddpflow.training.result import TrainResult
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.workloads.charlm.data import fetch_corpus, format_corpus
from ddpflow.workloads.charlm.job import CharLMTrainJob
from ddpflow.workloads.sweep import (
    SweepSetup,
    TrialOutcome,
    TrialSpec,
    WorkerSlots,
    build_trials,
    run_queued,
    run_trial,
    trial_rank,
)

TIMEOUT_S = 600.0


def _setup(project: Path, mode: str, num_trials: int) -> SweepSetup:
    artifact_root = str(project / "artifacts")
    raw = fetch_corpus(str(DEFAULT_CORPUS_PATH), artifact_root)
    corpus = format_corpus(raw.uri, artifact_root, 0.1)
    tracking_uri = f"sqlite:///{project / 'mlflow.db'}"
    # Creating the parent run also creates the SQLite schema (~6 s): outside the timings.
    # The trials' checkpoints beside the store, not in ./mlruns of the working directory.
    location = default_artifact_location(tracking_uri, project)
    parent = start_run(tracking_uri, "sweep-bench", mode, {"trials": num_trials}, {}, location)
    return SweepSetup(corpus, parent, "sweep-bench", artifact_root, location, keep_last=1)


def _timed(fn: Callable[[], list[TrialOutcome]]) -> tuple[float, list[TrialOutcome]]:
    started = time.perf_counter()
    outcomes = fn()
    return time.perf_counter() - started, outcomes


def on_cluster(
    specs: list[TrialSpec], setup: SweepSetup, num_workers: int
) -> tuple[float, float, list[TrialOutcome]]:
    """(start-up seconds, sweep seconds, outcomes) with one trial per worker at a time."""
    started = time.perf_counter()
    with local_cluster(num_workers) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(num_workers, timeout=120)
        # torch + mlflow imports
        client.run(importlib.import_module, "ddpflow.workloads.sweep.trial")
        startup_s = time.perf_counter() - started
        workers = sorted(cluster_workers(client))

        def train(job: CharLMTrainJob, assigned: list[str]) -> TrainResult:
            settings = job.train_settings()
            ((result, _),) = launch(
                client,
                rank_entry,
                trial_rank,
                (job,),
                settings,
                job.run,
                world_size=1,
                workers=assigned,
                timeout_s=TIMEOUT_S,
            )
            return result

        def one(spec: TrialSpec, assigned: list[str]) -> TrialOutcome:
            return run_trial(spec, assigned, setup, train)

        seconds, outcomes = _timed(lambda: run_queued(specs, WorkerSlots(workers), 1, one))
    return startup_s, seconds, outcomes


def _train_here(job: CharLMTrainJob, workers: list[str]) -> TrainResult:
    """A group of one in this process: the same rank function, no Dask."""
    spec = RankSpec(0, 1, "127.0.0.1", find_free_port(), "gloo", TIMEOUT_S, uuid.uuid4().hex)
    with process_group(spec) as rank_ctx:
        result, _ = rank_entry(rank_ctx, trial_rank, (job,), job.train_settings(), job.run)
        return result


def sequential(specs: list[TrialSpec], setup: SweepSetup) -> tuple[float, list[TrialOutcome]]:
    return _timed(lambda: [run_trial(spec, [], setup, _train_here) for spec in specs])


def _check(outcomes: list[TrialOutcome], mode: str) -> None:
    failed = [f"{o.spec.name}: {o.error}" for o in outcomes if not o.completed]
    if failed:
        raise SystemExit(f"{mode}: trials failed: {failed}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = command_line("bench.sweep_bench", __doc__)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2)
    return parser.parse_args(argv)


def _trials(args: argparse.Namespace) -> list[TrialSpec]:
    """N tiny trials that differ in learning rate (as many as asked)."""
    defaults = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": 0.005,
        "hidden_size": args.hidden_size,
        "num_layers": 1,
        "dropout": 0.0,
        "seed": 0,
    }
    return build_trials(
        {"lr": [round(0.001 * 2**i, 6) for i in range(args.trials)]}, None, defaults
    )


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    specs = _trials(args)
    with tempfile.TemporaryDirectory(prefix="ddpflow-sweep-bench-") as tmp:
        setup = _setup(Path(tmp), "cluster", len(specs))
        startup_s, cluster_s, on = on_cluster(specs, setup, args.workers)
        _check(on, "cluster")
        seq_s, seq = sequential(specs, _setup(Path(tmp), "sequential", len(specs)))
        _check(seq, "sequential")
    drift = max(abs(a.final_val_loss - b.final_val_loss) for a, b in zip(on, seq, strict=True))
    print(
        f"sweep benchmark: {len(specs)} trials (LSTM {args.hidden_size}x1, {args.epochs} "
        f"epochs, batch {args.batch_size}, lr {[s.config.lr for s in specs]})"
    )
    for label, value in [
        ("cluster start-up (not counted)", f"{startup_s:7.1f} s"),
        (f"on a {args.workers}-worker LocalCluster", f"{cluster_s:7.1f} s"),
        ("one after another in one process", f"{seq_s:7.1f} s"),
        ("  torch threads in that process", f"{torch.get_num_threads():7d}"),
        ("wall-time ratio sequential/cluster", f"{seq_s / cluster_s:7.2f}x"),
        ("largest final val loss difference", f"{drift:7.4f}  (same trials, same seeds)"),
    ]:
        print(f"  {label:<36}{value}")


if __name__ == "__main__":
    main()
