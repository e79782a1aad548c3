"""The runs bench.launch times: a torchrun launch, a flow run, a flow on warm services.

Each runs as a subprocess in a temporary project and returns its Timeline (see
bench.launch_timing); bench.launch turns them into results.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.launch_timing import BATCH_SIZE, LOG_EVERY, WORLD_SIZE, Timeline, stages, timeline
from ddpflow.workloads.charlm.corpus import load_names

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT_S = 540
QUICK_NAMES = 10_000  # about 60 steps of 2 x 512: three 20-step windows
FLOW_COMMAND = (sys.executable, "-m", "flows.train_charlm")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run to completion with output to `log`; (launch timestamp, wall seconds)."""
    with log.open("w") as out:
        launch_ts = time.time()
        env = {**env, "BENCH_LAUNCH_TS": repr(launch_ts)}
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except BaseException:  # a timeout or Ctrl-C: leave no flow, cluster or rank behind
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: its children go with it
            proc.wait()
            raise
        wall_s = time.time() - launch_ts
    if code != 0:
        raise RuntimeError(f"{cmd[:3]} exited {code}:\n{log.read_text()[-4000:]}")
    return launch_ts, wall_s


def _project_env(project: Path, world_size: int = WORLD_SIZE) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.pop("DDPFLOW_DASK_ADDRESS", None)  # always the flow's own LocalCluster
    env.update(
        {
            "DDPFLOW_ARTIFACT_ROOT": str(project / "artifacts"),
            "DDPFLOW_DASK_WORKERS": str(world_size),
            "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
            "PREFECT_HOME": str(project / ".prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PYTHONPATH": str(REPO),
        }
    )
    return env


def run_torchrun(project: Path, source: str, tag: str, world_size: int = WORLD_SIZE) -> Timeline:
    cmd = [
        str(BIN / "torchrun"),
        "--standalone",
        f"--nproc_per_node={world_size}",
        str(REPO / "bench" / "torchrun_step.py"),
        f"--source={source}",
        f"--batch-size={BATCH_SIZE}",
        f"--log-every-steps={LOG_EVERY}",
    ]
    log = project / f"torchrun-{tag}.log"
    launch_ts, wall_s = _run(cmd, project, _project_env(project, world_size), log)
    line = next(x for x in log.read_text().splitlines() if x.startswith("BENCH_RESULT "))
    report = json.loads(line.removeprefix("BENCH_RESULT "))
    logs = [(r["time"], r["samples_per_s"]) for r in report["records"]]
    result = timeline(launch_ts, logs, report["epoch_samples_per_s"][0], world_size)
    return replace(result, total_s=wall_s, direct_first_step_s=report["first_step_ts"] - launch_ts)


def run_flow(
    project: Path,
    source: str,
    extra_env: dict[str, str] | None = None,
    tag: str = "flow",
    world_size: int = WORLD_SIZE,
    launcher: Sequence[str] = FLOW_COMMAND,
) -> tuple[Timeline, dict[str, float]]:
    """The flow's timeline and the launch-relative time of each stage it logged (the newest
    run of the project: a project may be run more than once). `extra_env` may point the
    flow at an MLflow server (MLFLOW_TRACKING_URI); its metrics are read from there.
    `launcher` is the command the flow's arguments follow (bench.startup_pieces runs the
    flow through bench.startup_off)."""
    project.mkdir(exist_ok=True)
    cmd = [*launcher, "--epochs", "1", "--source", source]
    cmd += ["--batch-size", str(BATCH_SIZE), "--num-names", "1", "--world-size", str(world_size)]
    log = project / f"{tag}.log"
    env = {**_project_env(project, world_size), **(extra_env or {})}
    launch_ts, wall_s = _run(cmd, project, env, log)
    from mlflow.tracking import MlflowClient  # here: MLflow's import is slow and only needed here

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("ddpflow-charlm")
    (run,) = client.search_runs(
        [experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1
    )

    def history(key: str) -> list:
        return sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)

    logs = [(m.timestamp / 1000, m.value) for m in history("samples_per_s")]
    epoch_rate = history("epoch_samples_per_s")[0].value
    result = replace(timeline(launch_ts, logs, epoch_rate, world_size), total_s=wall_s)
    return result, stages(log.read_text(), launch_ts)


def source_file(project: Path, quick: bool) -> str:
    """The shipped corpus, or in quick mode its first names (fewer steps per epoch)."""
    names, _ = load_names()
    path = project / "names.json"
    path.write_text(json.dumps(names[:QUICK_NAMES] if quick else names))
    return str(path)


def run_warm(
    root: Path, source: str, world_size: int = WORLD_SIZE
) -> tuple[Timeline, dict[str, float], Timeline]:
    """The flow on services that are already up, in a project that has run once; and
    torchrun beside those services while they idle (before the flow runs), which shows what
    their presence on the same cores costs any training."""
    from infra.procs import free_port, stop
    from infra.services import start_dask, start_prefect_server

    logs = root / "warm-services"
    logs.mkdir()
    server = start_prefect_server(free_port(), root / "warm-prefect-home", logs)
    try:
        worker_env = {"PREFECT_API_URL": server.url, "PYTHONPATH": str(REPO)}
        scheduler, workers = start_dask(free_port(), world_size, worker_env, logs)
        try:
            env = {"PREFECT_API_URL": server.url, "DDPFLOW_DASK_ADDRESS": scheduler.url}
            run_flow(root / "warm", source, env, "warm-up", world_size)
            beside = run_torchrun(root, source, "beside-services", world_size)
            return (*run_flow(root / "warm", source, env, "warm", world_size), beside)
        finally:
            stop(workers)
            stop(scheduler)
    finally:
        stop(server)
