"""What each start-up piece of a flow's command line saves its cold first step.

    .venv/bin/python -m bench.startup_pieces [--rounds 3] [--pieces P ...] [--record KEY]
    .venv/bin/python -m bench.startup_pieces --against DIR [--rounds 3]

Every run is bench.launch's cold run (bench.launch_runs.run_flow): `flows.train_charlm
--epochs 1` in a fresh temporary project (no PREFECT_API_URL: its own embedded API, MLflow
store and LocalCluster), on the first 10,000 names of the shipped corpus (bench.launch's
--quick; the first step does not depend on the corpus's length), the first completed step
read from rank 0's MLflow metrics. The flow runs through bench.startup_off, which switches
one piece off before running the flow module as `__main__`; "all on" runs through it too,
switching nothing. The pieces (bench/startup_off.py says how each is switched off):

  early_api              the embedded Prefect API started before the flow module's imports
                         (off: Prefect's own temporary server, on the copied database; the
                         early cluster needs the API's URL, so it is off with it)
  early_cluster          the LocalCluster started while the imports load
  prefect_db_template    the embedded API's first database copied from a migrated one
  mlflow_store_template  the project's first MLflow store copied from a migrated one
  forkserver             workers forked from a forkserver that imported torch and MLflow

A round runs A X1 A X2 ... A Xn (A: all on; the pieces' order reversed every other round)
and one more A ends the run, so each X has an A on either side; its paired difference is X
minus the mean of those two. A piece's saving is the median over rounds of its paired
differences; the ratio, the median of X over that mean. The 1-minute load average is taken
before each run.

With --against DIR the same pairs compare this checkout (X) with the checkout in DIR (A,
put first on PYTHONPATH), both run as `python -m flows.train_charlm`: the ratio is this
checkout's cold first step over DIR's.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Result, command_line, load_average, median, print_results, record_entry
from bench.launch_runs import FLOW_COMMAND, run_flow, source_file
from bench.startup_off import PIECES

KEEP_S = 1.0  # a piece that saves less of the cold first step is not worth its code
AGAINST_TARGET = 1.15


@dataclass(frozen=True)
class Variant:
    name: str
    launcher: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    variant: str
    first_step_s: float  # nan: the run failed
    load_1min: float


def _off(piece: str) -> Variant:
    name = "all on" if piece == "none" else f"{piece} off"
    return Variant(name, (sys.executable, "-m", "bench.startup_off", piece))


def schedule(on: Variant, others: list[Variant], rounds: int) -> list[Variant]:
    """A X1 A X2 ... A Xn per round, the Xs reversed every other round, and a closing A."""
    order: list[Variant] = []
    for r in range(rounds):
        for other in others if r % 2 == 0 else others[::-1]:
            order += [on, other]
    return [*order, on]


def measure(order: list[Variant]) -> list[Run]:
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-startup-") as tmp:
        root = Path(tmp)
        source = source_file(root, quick=True)
        for n, variant in enumerate(order):
            load = load_average()[0]
            started = time.time()
            try:
                timeline, _ = run_flow(
                    root / f"{n:02d}", source, extra_env=variant.env, launcher=variant.launcher
                )
                first = timeline.first_step_s
            except RuntimeError as error:  # one failed run costs its pairs, not the whole run
                print(f"run {n} ({variant.name}) failed: {str(error)[-1500:]}", flush=True)
                first = float("nan")
            runs.append(Run(variant.name, first, load))
            print(
                f"run {n + 1}/{len(order)} {variant.name}: first step {first:.2f} s "
                f"(load {load:.2f}, {time.time() - started:.0f} s)",
                flush=True,
            )
    return runs


def pairs(runs: list[Run]) -> dict[str, list[tuple[float, float]]]:
    """(X, mean of the A runs on either side) for every X between two successful A runs."""
    found: dict[str, list[tuple[float, float]]] = {}
    for i in range(1, len(runs) - 1, 2):
        x, before, after = runs[i].first_step_s, runs[i - 1].first_step_s, runs[i + 1].first_step_s
        if not any(math.isnan(v) for v in (x, before, after)):  # all three ran
            found.setdefault(runs[i].variant, []).append((x, (before + after) / 2))
        else:
            found.setdefault(runs[i].variant, [])
    return found


def _load_note(runs: list[Run]) -> str:
    loads = [r.load_1min for r in runs]
    return f"1-min load {min(loads):.1f}-{max(loads):.1f} (median {median(loads):.1f})"


def piece_results(runs: list[Run]) -> list[Result]:
    on = [r.first_step_s for r in runs if r.variant == "all on" and not math.isnan(r.first_step_s)]
    rows = [
        Result(
            "startup_pieces",
            "cold first step, all on",
            median(on),
            median(on),
            "s",
            1.0,
            "(the baseline)",
            None,
            f"{len(on)} run(s): {', '.join(f'{v:.1f}' for v in on)}; {_load_note(runs)}",
        )
    ]
    for variant, found in pairs(runs).items():
        saved = [x - a for x, a in found]
        saving = median(saved)
        rows.append(
            Result(
                "startup_pieces",
                f"cold first step, {variant}",
                median([x for x, _ in found]),
                median([a for _, a in found]),
                "s",
                median([x / a for x, a in found]),
                f"off - on >= {KEEP_S:g} s: keep",
                saving >= KEEP_S if found else None,
                f"off - on: median {saving:.2f} s over {len(found)} pair(s), each "
                f"{', '.join(f'{d:+.2f}' for d in saved)} s",
                {"pairs": found},
            )
        )
    return rows


def against_results(runs: list[Run], against: str) -> list[Result]:
    found = next(iter(pairs(runs).values()), [])
    ratio = median([x / a for x, a in found])
    return [
        Result(
            "startup_pieces",
            "cold first step, this checkout",
            median([x for x, _ in found]),
            median([a for _, a in found]),
            "s",
            ratio,
            f"this/{against} <= {AGAINST_TARGET:g}",
            ratio <= AGAINST_TARGET if found else None,
            f"{len(found)} pair(s), this - other: "
            f"{', '.join(f'{x - a:+.2f}' for x, a in found)} s; {_load_note(runs)}",
            {"pairs": found},
        )
    ]


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.startup_pieces", __doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--pieces", nargs="+", choices=list(PIECES), default=list(PIECES), help="(default: all)"
    )
    parser.add_argument(
        "--against", metavar="DIR", help="compare this checkout with the one in DIR instead"
    )
    parser.add_argument(
        "--record",
        metavar="KEY",
        help="also write the rows as entry KEY of results/latest.json (other entries kept)",
    )
    args = parser.parse_args(argv)
    load_before, started = load_average(), time.time()
    if args.against:
        other = str(Path(args.against).resolve())
        base = Variant(other, FLOW_COMMAND, {"PYTHONPATH": other})
        runs = measure(schedule(base, [Variant("this checkout", FLOW_COMMAND)], args.rounds))
        results = against_results(runs, other)
    else:
        runs = measure(schedule(_off("none"), [_off(p) for p in args.pieces], args.rounds))
        results = piece_results(runs)
    print_results("start-up pieces: the cold first step", results)
    if args.record:
        command = " ".join(["python -m bench.startup_pieces", *sys.argv[1:]])
        record_entry(
            args.record, command, load_before, results, started, runs=[r.__dict__ for r in runs]
        )


if __name__ == "__main__":
    main()
