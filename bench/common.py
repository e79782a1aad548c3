"""What every benchmark shares: its command line, a result row, the table printer, timers and
the machine."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# One intra-op thread per process, as ddpflow's ranks run: 2 threads per rank on 2 cores
# oversubscribe them (an epoch took about 30 times longer).
BENCH_THREADS = 1


@dataclass(frozen=True)
class Result:
    """One figure next to the baseline measured in the same run.

    `ratio` is the quantity the target is stated in, and `target` says how it is formed
    (e.g. "seed/ddpflow time >= 50"); `met` is None for rows given for information only.
    """

    benchmark: str
    figure: str
    value: float
    baseline: float
    unit: str
    ratio: float
    target: str
    met: bool | None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    percent: bool = False  # the ratio is a share in %, not a factor

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(fastest wall time in s, last result): the minimum is the figure least hit by load."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return min(times), result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fmt(value: float, unit: str) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f} {unit}"
    if abs(value) >= 10:
        return f"{value:.1f} {unit}"
    if abs(value) >= 1:
        return f"{value:.2f} {unit}"
    return f"{value:.3g} {unit}"


def format_table(results: list[Result]) -> str:
    """A fixed-width table: benchmark, figure, value, baseline, ratio, target, met?."""
    header = ("benchmark", "figure", "ddpflow", "baseline", "ratio", "target", "met?")
    rows = [header] + [
        (
            r.benchmark,
            r.figure,
            _fmt(r.value, r.unit),
            _fmt(r.baseline, r.unit),
            f"{r.ratio:.2f} %" if r.percent else f"{r.ratio:.3g}",
            r.target,
            {True: "yes", False: "NO", None: "-"}[r.met],
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  [{r.benchmark}/{r.figure}] {r.notes}" for r in results if r.notes]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """Enough to tell two result files apart: where, when and with what they ran."""
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "load_average_1_5_15": [round(v, 2) for v in load_average()],
    }


def print_results(title: str, results: list[Result]) -> None:
    print(f"\n== {title} ==")
    print(format_table(results))


def stop_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so every `finally` of a benchmark runs.

    `timeout` and job schedulers stop a process with SIGTERM, whose default action ends it at
    once: the Prefect servers, Dask clusters and flows a benchmark started would outlive it
    and slow whatever runs next. SystemExit unwinds through their `finally` blocks instead.
    """
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def command_line(
    module: str, doc: str | None, quick: str | None = None, record: str | None = None
) -> argparse.ArgumentParser:
    """The parser every benchmark starts from: `python -m <module>`, its docstring as the
    help text (as written), `--quick` described by `quick`, `--record` (write entry `record`
    of results/latest.json) when `record` is given; and SIGTERM (`timeout`, a job scheduler)
    still stops the services a benchmark started."""
    stop_cleanly_on_sigterm()
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    if record is not None:
        where = f"results/{LATEST.name}"
        parser.add_argument(
            "--record", action="store_true", help=f"also write entry {record} of {where}"
        )
    return parser


LATEST = Path(__file__).with_name("results") / "latest.json"


def record_entry(
    key: str,
    command: str,
    load_before: tuple[float, float, float],
    results: list[Result],
    started: float | None = None,
    **more: Any,
) -> None:
    """Write entry `key` of results/latest.json (the file's other entries are kept): the
    command, the date (`started`, a time.time(), or now), the machine, the load before and
    after, the rows and `more`."""
    report = json.loads(LATEST.read_text()) if LATEST.exists() else {}
    report[key] = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
        **more,
        "results": [r.as_dict() for r in results],
    }
    LATEST.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {LATEST} ({key})")
