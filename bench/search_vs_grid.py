"""Search, not only grids: the sweep flow's ASHA + TPE search against its full grid.

    .venv/bin/python -m bench.search_vs_grid [--epochs 4] [--seed 0 [1 2]] [--ray] [--record KEY]

One discrete space of the char-LM (lr 5 values x hidden_size 3 x num_layers 2 = 30 points:
lr spans too small to too large, size and depth change an epoch's cost about 6 fold, so a
search has both bad and dear points to skip), on the first `--names` names of the shipped
corpus. Each run is `python -m flows.sweep_charlm` in a fresh project (a 2-worker
LocalCluster, env from bench.launch_runs._project_env):

- the grid (`--grid`): every point, every epoch; the baseline.
- per seed, the search (`--search` with `choices` of the same values, `--sampler tpe
  --pruner asha --min-epochs 1 --eta 2 --n-trials` 2/5 of the grid): rungs at epochs 1, 2, 4.
  The trials train with the grid's training seed (a one-value `seed` choice), so a searched
  point's losses are the grid's; `--seed` seeds the sampler only.

Figure: the trial-epochs (and wall seconds, from the first trial's start) spent until the
best *completed* trial's final holdout loss is within 1 % of the grid's best, counted from
the child runs' `val_loss` points in timestamp order. The grid's baseline is all of it: its
best is known only once every point ran. Goal: search/grid <= 1/3.

With `--ray`: Ray Tune's ASHAScheduler + OptunaSearch (bench.ray_trials) on the same space,
number of trials, epochs, grace period 1, reduction factor 2, sampler and training function,
2 trials at a time of 1 CPU each. Figures: the best completed trial's final loss of each at
equal trial-epochs and at equal wall time (the smaller of the two totals); goal: ours <= Ray's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Result, load_average, print_results, record_entry
from bench.common import command_line as bench_parser
from bench.launch_runs import REPO, _project_env
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH

BENCH = "search_vs_grid"
EXPERIMENT = "ddpflow-charlm-sweep"
TIMEOUT_S = 1500  # one flow run; a loaded machine takes several times its quiet time
WORKERS = 2
SPACE: dict[str, list[Any]] = {
    "lr": [0.0003, 0.001, 0.003, 0.01, 0.03],
    "hidden_size": [32, 64, 128],
    "num_layers": [1, 2],
}
BATCH_SIZE = 512
DROPOUT = 0.1
TRAIN_SEED = 0  # the grid's and every searched trial's initial weights and data order
MIN_EPOCHS, ETA = 1, 2
WITHIN = 0.01  # "as good as the grid": final holdout loss <= grid best x 1.01


@dataclass(frozen=True)
class Point:
    """One epoch's holdout loss of one trial; `final` when it is the trial's last epoch."""

    trial: str
    epoch: int
    val_loss: float
    at: float  # unix seconds
    final: bool


@dataclass(frozen=True)
class Sweep:
    """One sweep's loss points, in time order, and when its first trial started."""

    label: str
    points: list[Point]
    first_start: float
    process_s: float  # the whole run: flow start-up (or ray.init) included
    states: dict[str, int]
    extra: dict[str, Any]

    @property
    def trial_epochs(self) -> int:
        return len(self.points)

    @property
    def wall_s(self) -> float:
        return self.points[-1].at - self.first_start if self.points else math.nan

    @property
    def best(self) -> float:
        return min((p.val_loss for p in self.points if p.final), default=math.nan)

    def reach(self, target: float) -> tuple[int, float] | None:
        """(trial-epochs, wall seconds) when a completed trial's final loss first is <= target."""
        for n, p in enumerate(self.points, start=1):
            if p.final and p.val_loss <= target:
                return n, p.at - self.first_start
        return None

    def best_by_epochs(self, trial_epochs: int) -> float:
        """The best completed trial's final loss after the first `trial_epochs` points."""
        return min((p.val_loss for p in self.points[:trial_epochs] if p.final), default=math.nan)

    def best_by_time(self, seconds: float) -> float:
        done = (p for p in self.points if p.final and p.at - self.first_start <= seconds)
        return min((p.val_loss for p in done), default=math.nan)


def write_corpus(folder: Path, num_names: int) -> Path:
    """The shipped corpus's first names (as tests/helpers/charlm_runs.small_corpus cuts it)."""
    path = folder / f"names-{num_names}.json"
    path.write_text(json.dumps(json.loads(DEFAULT_CORPUS_PATH.read_bytes())[:num_names]))
    return path


def run_flow(project: Path, args: list[str]) -> float:
    """`python -m flows.sweep_charlm args` in `project`, output to its flow.log; wall seconds."""
    project.mkdir(parents=True)
    log = project / "flow.log"
    cmd = [sys.executable, "-m", "flows.sweep_charlm", *args]
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=project,
            env=_project_env(project, WORKERS),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except BaseException:  # a timeout or Ctrl-C: leave no flow, cluster or rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {code}:\n{log.read_text()[-4000:]}")
    return time.perf_counter() - started


def read_sweep(label: str, tracking_uri: str, epochs: int, process_s: float) -> Sweep:
    """The child runs' val_loss points of the one sweep in `tracking_uri`, in time order."""
    from mlflow.tracking import MlflowClient  # slow to import; only needed once a sweep ran

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    every = client.search_runs([experiment.experiment_id], max_results=1000)
    runs = [r for r in every if "ddpflow.trial" in r.data.tags]  # the parent has none
    points: list[Point] = []
    states: dict[str, int] = {}
    free_delays: list[float] = []
    for run in runs:
        state = run.data.tags.get("ddpflow.trial_state", "COMPLETE")  # a grid's tag-less trial
        states[state] = states.get(state, 0) + 1
        history = sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=_step)
        points += [
            Point(run.info.run_id, m.step, m.value, m.timestamp / 1000, m.step == epochs)
            for m in history
        ]
        if state == "PRUNED" and history and run.info.end_time:
            # From the loss that got it pruned to its run's end: how soon its worker is free.
            free_delays.append(run.info.end_time / 1000 - history[-1].timestamp / 1000)
    points.sort(key=lambda p: p.at)
    first_start = min(r.info.start_time for r in runs) / 1000
    extra = {"pruned_free_delay_s": _summary(free_delays)} if free_delays else {}
    extra["trial_epochs_per_trial"] = _epochs_per_trial(points)
    # A sampler may ask a discrete point again: with the same training seed it is paid twice.
    extra["distinct_points"] = len({tuple(r.data.params.get(k) for k in SPACE) for r in runs})
    return Sweep(label, points, first_start, process_s, states, extra)


def _step(metric: Any) -> int:
    return int(metric.step)


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": round(ordered[0], 2),
        "median": round(ordered[len(ordered) // 2], 2),
        "max": round(ordered[-1], 2),
    }


def _epochs_per_trial(points: Iterable[Point]) -> dict[int, int]:
    """How many trials trained 1, 2, ... epochs (the rungs they stopped at)."""
    per: dict[str, int] = {}
    for p in points:
        per[p.trial] = max(per.get(p.trial, 0), p.epoch)
    counts: dict[int, int] = {}
    for n in per.values():
        counts[n] = counts.get(n, 0) + 1
    return dict(sorted(counts.items()))


def common_args(source: Path, epochs: int) -> list[str]:
    return [
        "--source",
        str(source),
        "--epochs",
        str(epochs),
        "--batch-size",
        str(BATCH_SIZE),
        "--dropout",
        str(DROPOUT),
    ]


def run_grid(root: Path, source: Path, epochs: int) -> Sweep:
    project = root / "grid"
    args = [*common_args(source, epochs), "--seed", str(TRAIN_SEED), "--grid", json.dumps(SPACE)]
    wall = run_flow(project, args)
    return read_sweep("grid", f"sqlite:///{project / 'mlflow.db'}", epochs, wall)


def run_search(
    root: Path, source: Path, epochs: int, seed: int, n_trials: int, budget_epochs: int | None
) -> Sweep:
    project = root / f"search-{seed}"
    space = {k: {"choices": v} for k, v in SPACE.items()}
    space["seed"] = {"choices": [TRAIN_SEED]}  # the grid's weights; --seed seeds the sampler
    args = [
        *common_args(source, epochs),
        "--search",
        json.dumps(space),
        "--sampler",
        "tpe",
        "--pruner",
        "asha",
        "--min-epochs",
        str(MIN_EPOCHS),
        "--eta",
        str(ETA),
        *(
            ["--budget-epochs", str(budget_epochs)]  # the flow asks until it is spent
            if budget_epochs
            else ["--n-trials", str(n_trials)]
        ),
        "--seed",
        str(seed),
    ]
    wall = run_flow(project, args)
    return read_sweep(f"asha seed {seed}", f"sqlite:///{project / 'mlflow.db'}", epochs, wall)


def run_ray(root: Path, source: Path, epochs: int, seed: int, n_trials: int) -> Sweep:
    """Ray Tune's ASHA on the same space, trials training into this bench's own store."""
    from bench.ray_trials import RayTrialSetup, run_ray_search
    from ddpflow.tracking.run import default_artifact_location, end_run, start_run
    from ddpflow.workloads.charlm.data import fetch_corpus, format_corpus

    project = root / f"ray-{seed}"
    project.mkdir()
    artifact_root = str(project / "artifacts")
    raw = fetch_corpus(str(source), artifact_root)
    corpus = format_corpus(raw.uri, artifact_root, 0.1)  # the flow's holdout_fraction
    tracking_uri = f"sqlite:///{project / 'mlflow.db'}"
    location = default_artifact_location(tracking_uri, project / "mlflow")
    parent = start_run(tracking_uri, "ray-tune", f"ray seed {seed}", {"seed": seed}, {}, location)
    setup = RayTrialSetup(
        corpus.train_uri,
        corpus.val_uri,
        tracking_uri,
        "ray-tune",
        parent.run_id,
        artifact_root,
        location,
        epochs,
        BATCH_SIZE,
        DROPOUT,
        TRAIN_SEED,
    )
    try:
        ray = run_ray_search(setup, SPACE, n_trials, MIN_EPOCHS, ETA, seed, project / "tune", REPO)
    finally:
        end_run(parent)
    points = sorted(
        (Point(p.trial, p.epoch, p.val_loss, p.at, p.epoch == epochs) for p in ray.points),
        key=lambda p: p.at,
    )
    finals = sum(p.final for p in points)
    states = {"COMPLETE": finals, "STOPPED": ray.num_trials - finals}
    extra = {"trial_epochs_per_trial": _epochs_per_trial(points)}
    return Sweep(f"ray seed {seed}", points, ray.first_start, ray.wall_s, states, extra)


def to_goal(search: Sweep, grid: Sweep, seed: int) -> tuple[list[Result], dict[str, Any]]:
    """The search's trial-epochs and wall seconds to within 1 % of the grid's best, and each
    one's best, against the grid's totals."""
    target = grid.best * (1 + WITHIN)
    reached = search.reach(target)
    epochs, wall = reached if reached else (search.trial_epochs, search.wall_s)
    never = "" if reached else "never within 1 %: its total is shown; "
    note = (
        f"{never}{search.trial_epochs} trial-epochs in all, states {search.states}, "
        f"epochs per trial {search.extra['trial_epochs_per_trial']}"
    )
    rows = [
        Result(
            BENCH,
            f"trial-epochs to grid best +1 % (seed {seed})",
            epochs,
            grid.trial_epochs,
            "ep",
            epochs / grid.trial_epochs,
            "asha/grid <= 0.333",
            reached is not None and epochs / grid.trial_epochs <= 1 / 3,
            note,
        ),
        Result(
            BENCH,
            f"wall to grid best +1 % (seed {seed})",
            wall,
            grid.wall_s,
            "s",
            wall / grid.wall_s,
            "asha/grid <= 0.333",
            reached is not None and wall / grid.wall_s <= 1 / 3,
            "from each sweep's first trial start",
        ),
        Result(
            BENCH,
            f"best final val loss (seed {seed})",
            search.best,
            grid.best,
            "",
            search.best / grid.best,
            "info",
            None,
        ),
    ]
    # Keys apart from sweep_entry's: those are the search's totals, these its figure.
    reach = {"reached": reached is not None, "to_target_trial_epochs": epochs}
    return rows, {**reach, "to_target_wall_s": round(wall, 1)}


def against_ray(ours: Sweep, ray: Sweep, seed: int) -> list[Result]:
    """Each search's best completed loss at the trial-epochs and seconds both spent."""
    epochs = min(ours.trial_epochs, ray.trial_epochs)
    seconds = min(ours.wall_s, ray.wall_s)
    at_epochs = ours.best_by_epochs(epochs), ray.best_by_epochs(epochs)
    at_time = ours.best_by_time(seconds), ray.best_by_time(seconds)
    return [
        Result(
            BENCH,
            f"best loss at {epochs} trial-epochs vs Ray (seed {seed})",
            at_epochs[0],
            at_epochs[1],
            "",
            at_epochs[0] / at_epochs[1],
            "ours/ray <= 1",
            _at_most(at_epochs[0], at_epochs[1]),
            f"ours {ours.trial_epochs} trial-epochs in all, Ray {ray.trial_epochs} "
            f"(states {ray.states}, epochs per trial {ray.extra['trial_epochs_per_trial']})",
        ),
        Result(
            BENCH,
            f"best loss at {seconds:.0f} s vs Ray (seed {seed})",
            at_time[0],
            at_time[1],
            "",
            at_time[0] / at_time[1],
            "ours/ray <= 1",
            _at_most(at_time[0], at_time[1]),
            f"trials' wall: ours {ours.wall_s:.0f} s, Ray {ray.wall_s:.0f} s; whole runs: "
            f"flow {ours.process_s:.0f} s, ray.init+fit {ray.process_s:.0f} s",
        ),
    ]


def _at_most(ours: float, theirs: float) -> bool:
    """Ours no worse; a side with no completed trial yet counts as infinitely bad."""
    ours = ours if math.isfinite(ours) else math.inf
    theirs = theirs if math.isfinite(theirs) else math.inf
    return ours <= theirs and math.isfinite(ours)


def sweep_entry(sweep: Sweep) -> dict[str, Any]:
    """A sweep's raw numbers for the record."""
    return {
        "trial_epochs": sweep.trial_epochs,
        "trials_wall_s": round(sweep.wall_s, 1),
        "process_s": round(sweep.process_s, 1),
        "best_final_val_loss": round(sweep.best, 5),
        "states": sweep.states,
        **sweep.extra,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser("bench.search_vs_grid", __doc__)
    parser.add_argument("--epochs", type=int, default=4, help="every trial's most epochs")
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="sampler seeds")
    parser.add_argument("--names", type=int, default=4000, help="first names of the corpus")
    parser.add_argument("--n-trials", type=int, default=None, help="default: 2/5 of the grid")
    parser.add_argument(
        "--budget-epochs",
        type=int,
        default=None,
        help="the search's budget in trial-epochs instead of --n-trials (not with --ray)",
    )
    parser.add_argument("--ray", action="store_true", help="also Ray Tune's ASHA, per seed")
    parser.add_argument("--record", metavar="KEY", help="write entry KEY of results/latest.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.budget_epochs and args.ray:
        raise SystemExit(
            "--ray compares equal numbers of trials: give --n-trials, not --budget-epochs"
        )
    grid_size = math.prod(len(v) for v in SPACE.values())
    n_trials = args.n_trials or grid_size * 2 // 5
    load_before, started = load_average(), time.time()
    results: list[Result] = []
    raw: dict[str, Any] = {"space": SPACE, "n_trials": n_trials, "names": args.names}
    raw["budget_epochs"] = args.budget_epochs
    with tempfile.TemporaryDirectory(prefix="ddpflow-search-bench-") as tmp:
        root = Path(tmp)
        source = write_corpus(root, args.names)
        grid = run_grid(root, source, args.epochs)
        raw["grid"] = sweep_entry(grid)
        print(f"grid: {raw['grid']}, load {load_average()}", flush=True)
        for seed in args.seed:
            search = run_search(root, source, args.epochs, seed, n_trials, args.budget_epochs)
            rows, reached = to_goal(search, grid, seed)
            results += rows
            raw[f"asha_seed_{seed}"] = {**sweep_entry(search), **reached}
            print(f"asha seed {seed}: {raw[f'asha_seed_{seed}']}, load {load_average()}")
            if args.ray:
                ray = run_ray(root, source, args.epochs, seed, n_trials)
                results += against_ray(search, ray, seed)
                raw[f"ray_seed_{seed}"] = sweep_entry(ray)
                print(f"ray seed {seed}: {raw[f'ray_seed_{seed}']}, load {load_average()}")
            print_results(f"search vs grid (so far, load {load_average()})", results)
    print(
        f"\nspace {SPACE} ({grid_size} points), {args.epochs} epochs, {n_trials} searched "
        f"trials, first {args.names} names; load before {load_before}, after {load_average()}"
    )
    print_results("search vs grid", results)
    if args.record:
        command = "python -m bench.search_vs_grid " + " ".join(argv or sys.argv[1:])
        record_entry(args.record, command, load_before, results, started, raw=raw)


if __name__ == "__main__":
    main()
