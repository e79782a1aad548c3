"""Launch overhead: the real flow vs a bare torchrun launch of the same training step.

    .venv/bin/python -m bench.launch [--quick]

(i)  ddpflow: `python -m flows.train_charlm --epochs 1` as a subprocess in a fresh temporary
     project (its own artifact folder, MLflow SQLite file and PREFECT_HOME, so Prefect's and
     MLflow's databases are created on the way: a first run in a new project). The flow
     starts its Prefect API, a 2-worker LocalCluster, runs pre-flight, download, format,
     creates the MLflow run, launches 2 DDP ranks, trains, evaluates and registers.
(ii) torchrun: `torchrun --standalone --nproc_per_node=2 bench/torchrun_step.py`, the same
     data path, model, batch and step, with nothing around it.
(iii) warm (full mode, or --warm): the same flow against services that are already up, as a
     deployment has them: a Prefect server and a Dask scheduler with 2 `dask worker`
     processes started as the stack starts them (infra/services.py, so with WORKER_ENV), and
     a project that has run once (its MLflow database and formatted data exist). The second
     run is measured. Between the two, torchrun runs once more while those services idle:
     a diagnostic of what their presence on the same cores costs any training.

Time to the first completed step. Rank 0 timestamps each `train_loss`/`samples_per_s` log
(every 20 steps) with time.time(), and `samples_per_s` of the first window is
20 x batch x ranks / (seconds since training started). So for both launches:
    training start  = t(first log) - 20 x batch x ranks / samples_per_s(first window)
    first step done = training start + batch x ranks / steady samples/s
minus the launch time (time.time() taken just before the subprocess starts). The flow's
values come from MLflow (`get_metric_history`), torchrun's from rank 0's own records;
torchrun also stamps its first optimizer step directly, which checks the estimate.

Steady-state samples/s: the median of the `samples_per_s` windows after the first (which
holds the warm-up). In full mode torchrun runs before and after the flow and the baseline is
the mean of the two, so load that drifts steadily during the run favours neither side.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Result, command_line, load_average, print_results, record_entry
from bench.launch_runs import QUICK_NAMES, run_flow, run_torchrun, run_warm, source_file
from bench.launch_timing import BATCH_SIZE, WORLD_SIZE, Timeline

FIRST_STEP_TARGET = 1.5
STEADY_TARGET = 1.0


@dataclass(frozen=True)
class LaunchRuns:
    flow: Timeline
    flow_stages: dict[str, float]
    baselines: list[Timeline]
    warm: tuple[Timeline, dict[str, float]] | None  # the flow on running services
    beside: Timeline | None = None  # torchrun beside those services, idle
    world_size: int = WORLD_SIZE


def measure(quick: bool, warm: bool, world_size: int = WORLD_SIZE) -> LaunchRuns:
    """torchrun, the flow, [the flow on warm services], torchrun again (full)."""
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-launch-") as tmp:
        root = Path(tmp)
        source = source_file(root, quick)
        baselines = [run_torchrun(root, source, "before", world_size)]
        flow, flow_stages = run_flow(root / "flow", source, world_size=world_size)
        warm_run = run_warm(root, source, world_size) if warm else None
        if not quick:
            baselines.append(run_torchrun(root, source, "after", world_size))
    if warm_run is None:
        return LaunchRuns(flow, flow_stages, baselines, None, world_size=world_size)
    warm_flow, warm_stages, beside = warm_run
    return LaunchRuns(flow, flow_stages, baselines, (warm_flow, warm_stages), beside, world_size)


def _stage_notes(flow: Timeline, flow_stages: dict[str, float]) -> str:
    parts = [f"{name} {t:.1f} s" for name, t in flow_stages.items()]
    parts.append(f"training starts {flow.training_start_s:.1f} s")
    return "flow stages after launch: " + ", ".join(parts)


def _mean(baselines: list[Timeline], key: str) -> float:
    return sum(getattr(b, key) for b in baselines) / len(baselines)


def _results(runs: LaunchRuns) -> list[Result]:
    flow, baselines = runs.flow, runs.baselines
    first, direct, steady, epoch, total = (
        _mean(baselines, key)
        for key in (
            "first_step_s",
            "direct_first_step_s",
            "steady_samples_per_s",
            "epoch_samples_per_s",
            "total_s",
        )
    )
    first_ratio = flow.first_step_s / first
    steady_ratio = flow.steady_samples_per_s / steady
    runs_note = f"torchrun: mean of {len(baselines)} run(s)"
    return [
        Result(
            "launch",
            "launch -> first step done",
            flow.first_step_s,
            first,
            "s",
            first_ratio,
            f"flow/torchrun time <= {FIRST_STEP_TARGET:g}",
            first_ratio <= FIRST_STEP_TARGET,
            f"{_stage_notes(flow, runs.flow_stages)}; torchrun first step stamped directly at "
            f"{direct:.1f} s (estimate {first:.1f} s); {runs_note}",
            {"flow": flow.__dict__, "torchrun": [b.__dict__ for b in baselines]},
        ),
        Result(
            "launch",
            "steady samples/s",
            flow.steady_samples_per_s,
            steady,
            "samples/s",
            steady_ratio,
            f"flow/torchrun rate >= {STEADY_TARGET:g}",
            steady_ratio >= STEADY_TARGET,
            f"median of the 20-step windows after the first; {runs.world_size} rank(s) x batch "
            f"{BATCH_SIZE}; torchrun "
            f"runs: {', '.join(f'{b.steady_samples_per_s:,.0f}' for b in baselines)}",
        ),
        Result(
            "launch",
            "epoch samples/s",
            flow.epoch_samples_per_s,
            epoch,
            "samples/s",
            flow.epoch_samples_per_s / epoch,
            "flow/torchrun rate (info)",
            None,
            "whole first epoch incl. warm-up; the flow's includes its metric logging",
        ),
        Result(
            "launch",
            "whole run wall time",
            flow.total_s,
            total,
            "s",
            flow.total_s / total,
            "flow/torchrun time (info)",
            None,
            "1 epoch; the flow also evaluates and registers the model, torchrun only trains",
        ),
    ]


def _warm_rows(runs: LaunchRuns) -> list[Result]:
    if runs.warm is None:
        return []
    warm, warm_stages = runs.warm
    first = _mean(runs.baselines, "first_step_s")
    steady = _mean(runs.baselines, "steady_samples_per_s")
    first_ratio = warm.first_step_s / first
    return [
        Result(
            "launch",
            "launch -> first step done, warm services",
            warm.first_step_s,
            first,
            "s",
            first_ratio,
            f"flow/torchrun time <= {FIRST_STEP_TARGET:g}",
            first_ratio <= FIRST_STEP_TARGET,
            "Prefect server and Dask workers already up, second run of the project; "
            + _stage_notes(warm, warm_stages),
        ),
        Result(
            "launch",
            "steady samples/s, warm services",
            warm.steady_samples_per_s,
            steady,
            "samples/s",
            warm.steady_samples_per_s / steady,
            f"flow/torchrun rate >= {STEADY_TARGET:g}",
            warm.steady_samples_per_s / steady >= STEADY_TARGET,
            "on `dask worker` processes started as the stack starts them (WORKER_ENV)",
        ),
        *_beside_rows(runs.beside, steady, runs.world_size),
    ]


def _beside_rows(beside: Timeline | None, steady: float, world_size: int) -> list[Result]:
    if beside is None:
        return []
    return [
        Result(
            "launch",
            "steady samples/s, torchrun beside the idle warm services",
            beside.steady_samples_per_s,
            steady,
            "samples/s",
            beside.steady_samples_per_s / steady,
            "torchrun beside/alone (diagnostic)",
            None,
            "the same torchrun launch while the Prefect server, the Dask scheduler and its "
            f"{world_size} worker(s) idle on the same cores: what their presence alone costs "
            "a training",
        )
    ]


def run(
    quick: bool = False, warm: bool | None = None, world_size: int = WORLD_SIZE
) -> list[Result]:
    """`warm` (default: in full mode) adds the flow on already running services."""
    runs = measure(quick, not quick if warm is None else warm, world_size)
    results = _results(runs)
    return results[:2] + _warm_rows(runs) + results[2:]


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.launch", __doc__, quick=f"first {QUICK_NAMES} names only")
    parser.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the flow on a running Prefect server and Dask cluster (default: full)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=WORLD_SIZE,
        help=f"ranks (and Dask workers) of every launch (default {WORLD_SIZE}); 1 on 2 cores "
        "leaves a core to the services",
    )
    parser.add_argument(
        "--record",
        metavar="KEY",
        help="also write the rows as entry KEY of results/latest.json (other entries kept)",
    )
    args = parser.parse_args(argv)
    load_before, started = load_average(), time.time()
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, not {args.world_size}")
    results = run(args.quick, args.warm, args.world_size)
    print_results("launch overhead", results)
    if args.record:
        record(args.record, results, load_before, started, sys.argv)


def record(
    key: str, results: list[Result], load_before: tuple[float, ...], started: float, argv: list[str]
) -> None:
    """The rows, the machine, the date and the load, merged into results/latest.json."""
    from ddpflow.cluster.workers import WORKER_CONFIG

    command = " ".join(["python -m bench.launch", *argv[1:]])
    record_entry(key, command, load_before, results, started, worker_config=WORKER_CONFIG)


if __name__ == "__main__":
    main()
