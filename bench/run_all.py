"""Every ddpflow benchmark in one run, each figure next to its baseline measured in the same run.

    .venv/bin/python -m bench.run_all [--quick] [--only formatting launch ...]
                                      [--wait-for-load 1.0] [--output PATH]

Runs formatting, input_path, tracking_cost and launch (see each module's docstring for
exactly what it measures), prints one table (benchmark, figure, ddpflow, baseline, ratio,
target, met?) and writes it with a description of the machine to bench/results/latest.json
(latest-quick.json with --quick, so a quick check never replaces the recorded full run).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from bench import formatting, input_path, launch, tracking_cost
from bench.common import Result, command_line, format_table, load_average, machine

RESULTS = Path(__file__).resolve().parent / "results"
# Cheapest first; launch is last because it starts the most processes.
BENCHMARKS: dict[str, Callable[[bool], list[Result]]] = {
    "formatting": formatting.run,
    "input_path": input_path.run,
    "tracking_cost": tracking_cost.run,
    "launch": launch.run,
}
MAX_WAIT_S = 600
POLL_S = 60


def wait_for_quiet(max_load: float) -> None:
    """The machine is shared: wait (up to 10 min) for the 1-minute load to drop below max_load."""
    deadline = time.monotonic() + MAX_WAIT_S
    while (load := load_average()[0]) > max_load and time.monotonic() < deadline:
        print(f"load {load:.2f} > {max_load:g}: waiting {POLL_S} s for a quieter moment")
        time.sleep(POLL_S)
    print(f"starting at load {load_average()[0]:.2f}")


def run_all(names: list[str], quick: bool) -> tuple[list[Result], dict[str, float]]:
    results: list[Result] = []
    seconds: dict[str, float] = {}
    for name in names:
        started = time.perf_counter()
        found = BENCHMARKS[name](quick)
        seconds[name] = round(time.perf_counter() - started, 1)
        print(f"\n== {name} ({seconds[name]:.0f} s) ==\n{format_table(found)}", flush=True)
        results += found
    return results, seconds


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.run_all", __doc__, quick="fewer steps and repeats (~1.5 min)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--wait-for-load", type=float, metavar="LOAD", default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.wait_for_load is not None:
        wait_for_quiet(args.wait_for_load)
    before = machine()
    started = time.perf_counter()
    results, seconds = run_all(args.only, args.quick)
    table = format_table(results)
    print(f"\n== all benchmarks ({'quick' if args.quick else 'full'}) ==\n{table}")
    output = args.output or RESULTS / ("latest-quick.json" if args.quick else "latest.json")
    write_json(
        output,
        {
            "mode": "quick" if args.quick else "full",
            "machine": before,
            "load_average_after": [round(v, 2) for v in load_average()],
            "seconds": {**seconds, "total": round(time.perf_counter() - started, 1)},
            "table": table,
            "results": [r.as_dict() for r in results],
        },
    )
    print(f"\nwritten to {output}")


if __name__ == "__main__":
    main()
