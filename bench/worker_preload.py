"""What the local cluster's forkserver preload saves a flow run, in CPU seconds.

    PYTHONPATH=. .venv/bin/python -m bench.worker_preload [--quick] [--rounds N] [--record]

A LocalCluster's workers fork from one multiprocessing forkserver that imported
`ddpflow.cluster.forkserver.FORKSERVER_PRELOAD` once (a module a worker imports then costs it
nothing). This runs a tiny `python -m flows.train_charlm` (1 epoch, hidden size 16, 1 layer,
the shipped corpus, each run in a new project folder) with the shipped list and with the
baseline list BASELINE (the shipped list without the modules a rank imports the first time it
trains: torch._dynamo, which every torch optimizer imports when built, and MLflow's SQL
store, which a rank logging to a local `sqlite:` store imports), alternating the order
between rounds. Each run's process tree is sampled from /proc every 0.2 s (psutil): the
figures are the CPU seconds of the whole run (the flow process, its embedded Prefect API,
the forkserver, the workers) and of the workers alone. The ratio is shipped / baseline:
below 1 the shipped list costs less.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.common import Result, command_line, load_average, median, print_results, record_entry
from ddpflow.cluster.forkserver import FORKSERVER_PRELOAD

REPO = Path(__file__).resolve().parents[1]
BASELINE = ["distributed", "numpy", "torch", "mlflow"]
ARGS = ["--epochs", "1", "--hidden-size", "16", "--num-layers", "1", "--batch-size", "4096"]
# The flow as `python -m flows.train_charlm` runs it, with the preload list replaced first.
LAUNCH = (
    "import runpy, sys\n"
    "import ddpflow.cluster.forkserver as forkserver\n"
    "forkserver.FORKSERVER_PRELOAD[:] = sys.argv.pop(1).split(',')\n"
    "runpy.run_module('flows.train_charlm', run_name='__main__', alter_sys=True)\n"
)


def _one(preload: list[str]) -> dict[str, float]:
    """CPU seconds of one run's process tree: all of it, and its forkserver's children."""
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-preload-") as project:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        command = [sys.executable, "-c", LAUNCH, ",".join(preload), *ARGS]
        flow = subprocess.Popen(
            command, cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        seen: dict[int, tuple[float, bool]] = {}  # pid -> (CPU s, is a worker)
        root = psutil.Process(flow.pid)
        while flow.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for proc in tree:
                try:
                    cpu = sum(proc.cpu_times()[:2])
                    worker = "forkserver" in " ".join(proc.parent().cmdline())
                except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
                    continue
                seen[proc.pid] = (cpu, worker or seen.get(proc.pid, (0, False))[1])
            time.sleep(0.2)
        stderr = flow.stderr.read().decode(errors="replace") if flow.stderr else ""
        if flow.wait() != 0:
            raise RuntimeError(f"the flow failed:\n{stderr[-2000:]}")
    return {
        "total_cpu_s": sum(cpu for cpu, _ in seen.values()),
        "worker_cpu_s": sum(cpu for cpu, worker in seen.values() if worker),
    }


def measure(rounds: int) -> dict[str, list[dict[str, float]]]:
    variants = {"shipped": list(FORKSERVER_PRELOAD), "baseline": BASELINE}
    found: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            found[name].append(_one(variants[name]))
            print(f"round {r} {name}: {found[name][-1]}", flush=True)
    return found


def _results(found: dict[str, list[dict[str, float]]]) -> list[Result]:
    rows = []
    for key, figure in (("total_cpu_s", "CPU of the run"), ("worker_cpu_s", "CPU of its workers")):
        shipped = median([row[key] for row in found["shipped"]])
        baseline = median([row[key] for row in found["baseline"]])
        note = (
            f"median of {len(found['shipped'])} alternating run(s) of a tiny train_charlm; "
            f"shipped: {','.join(FORKSERVER_PRELOAD)}; baseline: {','.join(BASELINE)}"
        )
        ratio, how = shipped / baseline, "shipped/baseline (info)"
        rows.append(
            Result("worker_preload", figure, shipped, baseline, "s", ratio, how, None, note)
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.worker_preload", __doc__, quick="1 round", record="worker_preload")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both variants (3)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    load_before = load_average()
    results = _results(measure(rounds))
    print_results("the forkserver's preload: a tiny flow run's CPU", results)
    if args.record:
        command = "python -m bench.worker_preload" + (" --quick" if args.quick else "")
        record_entry("worker_preload", command, load_before, results)


if __name__ == "__main__":
    main()
