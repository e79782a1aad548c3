"""How fast a user's own flow reaches its first task in a new PREFECT_HOME, with and without
the migrated Prefect database `make venv` builds (docs/api.md "A fast first start").

    .venv/bin/python -m bench.user_flow_start [--rounds 3]

A user's project is a temporary folder holding one flow module on ddpflow's task runner
(`ddpflow.dask_task_runner()`, a one-worker LocalCluster) whose one task returns the time it
ran. Each round starts it twice as `python my_flow.py`, each time in a new PREFECT_HOME:
once as it is (Prefect's temporary server runs every migration), once with the documented
line `seed()` at the top of its `__main__`. The figure is the median over rounds of the
seconds from the process start to the first task; the baseline is the same without `seed()`.
The pairs alternate, so both see the same load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Result, command_line, median, print_results

REPO = Path(__file__).resolve().parents[1]
FLOW = """
import sys
import time

if __name__ == "__main__" and "--seed" in sys.argv:
    from ddpflow.integrations.prefect.db_template import seed

    seed()

from prefect import flow, task

import ddpflow


@task
def first() -> float:
    return time.time()


@flow(task_runner=ddpflow.dask_task_runner())
def my_flow() -> None:
    print(f"FIRST-TASK {first.submit().result()}", flush=True)


if __name__ == "__main__":
    my_flow()
"""
TIMEOUT_S = 300


def first_task_s(project: Path, seed: bool) -> float:
    """Seconds from starting the user's flow in a new PREFECT_HOME to its first task."""
    with tempfile.TemporaryDirectory(prefix="prefect-home-", dir=project) as home:
        env = {
            **os.environ,
            "PREFECT_HOME": home,
            "DDPFLOW_DASK_WORKERS": "1",
            "PYTHONPATH": str(REPO),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # Prefect gives its temporary server 20 s; the migrations alone take longer on
            # a busy 2-core machine.
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        }
        env.pop("PREFECT_API_URL", None)
        started = time.time()
        done = subprocess.run(
            [sys.executable, "my_flow.py", *(["--seed"] if seed else [])],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    marks = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("FIRST-TASK")]
    if done.returncode != 0 or not marks:
        raise RuntimeError(f"the user's flow failed: {done.stderr[-2000:]}")
    return float(marks[0]) - started


def run(rounds: int) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="user-project-") as folder:
        project = Path(folder)
        (project / "my_flow.py").write_text(FLOW)
        first_task_s(project, seed=True)  # warm-up: the page cache, not counted
        plain, seeded = [], []
        for _ in range(rounds):
            plain.append(first_task_s(project, seed=False))
            seeded.append(first_task_s(project, seed=True))
    value, baseline = median(seeded), median(plain)
    return [
        Result(
            benchmark="user_flow_start",
            figure="first task, new PREFECT_HOME",
            value=value,
            baseline=baseline,
            unit="s",
            ratio=value / baseline,
            target="seeded/plain < 1",
            met=value < baseline,
            notes=f"{rounds} alternating pairs; seeded {seeded}, plain {plain}",
        )
    ]


def main() -> None:
    parser = command_line("bench.user_flow_start", __doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print_results("a user's flow: time to its first task", run(args.rounds))


if __name__ == "__main__":
    main()
