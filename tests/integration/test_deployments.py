"""Deployments for real: the local stack (Prefect server + process worker, Dask scheduler and
workers, MLflow server, SeaweedFS S3), `prefect deploy` from deployments/prefect.yaml, and
`prefect deployment run ... --watch` as a user types it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from infra.state import BUCKET, StackState
from tests.helpers.charlm_runs import STEPPED_SOURCE
from tests.helpers.prefect_api import (
    FINAL_STATES,
    artifacts,
    create_flow_run,
    deployment,
    flow_run,
    flow_run_logs,
    state_history,
    wait_for_state,
)
from tests.helpers.s3_servers import list_keys

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = {
    "source": STEPPED_SOURCE, "hidden_size": 32, "num_layers": 1, "batch_size": 2048,
    "num_names": 5,
}  # fmt: skip
RETRAIN = "retrain-charlm/charlm-retrain-nightly"


@pytest.fixture(scope="module")
def stack(local_stack: StackState) -> Iterator[dict[str, str]]:
    """The session's stack, its S3 a SeaweedFS server with keys made at `up` (searched for
    in what Prefect and MLflow recorded)."""
    with pytest.MonkeyPatch.context() as patch:
        # This process's MlflowClient logs in to the stack's MLflow like every other client.
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            patch.setenv(key, local_stack.env[key])
        yield local_stack.env


def prefect(env: dict[str, str], *args: str, timeout_s: float = 400) -> str:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "DDPFLOW_", "AWS_"))
    }
    result = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=REPO,
        # PWD is what `prefect deploy` records as the flows' working directory.
        env={**clean, **env, "PWD": str(REPO), "PREFECT_CLI_WRAP_LINES": "false"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"prefect {' '.join(args)} failed:\n{output[-4000:]}"
    return output


def _param_flags(params: dict[str, object]) -> list[str]:
    # A flow's parameter model (`training={...}`) goes as JSON, as a user types it.
    shown = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in params.items()}
    return [arg for k, v in shown.items() for arg in ("--param", f"{k}={v}")]


def run_deployment(env: dict[str, str], name: str, **params: object) -> str:
    flags = _param_flags(params)
    return prefect(env, "deployment", "run", name, *flags, "--watch", "--watch-timeout", "300")


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text)


def watched(output: str) -> tuple[list[str], list[str]]:
    """`--watch`'s items in the order printed, each a log line (`▪`, with a multi-line log's
    indented lines) or an event (`●`), and the CLI's own lines after the last one."""
    lines = output.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(("▪ ", "● "))]
    assert starts, output[-4000:]
    items = ["\n".join(lines[i:j]) for i, j in zip(starts, [*starts[1:], len(lines)], strict=True)]
    last = items[-1].splitlines()
    # The last item's own lines are indented (a log's continuation lines); the rest is the CLI's.
    own = 1 + next((n for n, line in enumerate(last[1:]) if not line.startswith(" ")), len(last))
    items[-1] = "\n".join(last[:own])
    return items, last[own:]


@pytest.fixture(scope="module")
def deployed(stack) -> dict[str, str]:
    prefect(stack, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all")
    return stack


def test_deployment_run_completes_with_metrics_and_a_registered_model(deployed):
    started = time.monotonic()
    output = run_deployment(deployed, "train-charlm/charlm-ddp", training={"epochs": 1, **TINY})
    watch_s = time.monotonic() - started
    assert "Completed" in output
    client = MlflowClient(deployed["MLFLOW_TRACKING_URI"])
    runs = client.search_runs(
        [client.get_experiment_by_name("ddpflow-charlm").experiment_id],
        filter_string="tags.`ddpflow.workload` = 'charlm'",
    )
    assert len(runs) == 1
    run = runs[0]
    assert run.data.metrics["val_loss"] > 0 and "samples_per_s" in run.data.metrics
    versions = client.search_model_versions("name='ddpflow-charlm'")
    assert [v.run_id for v in versions] == [run.info.run_id]

    # docs/deployments.md "What --watch shows": the flow's summary is the last log line,
    # after Prefect's own "Finished in state Completed()"; only the CLI's verdict follows.
    items, after = watched(output)
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    summary = items[-1]
    assert summary.startswith("▪ ") and "ddpflow: pet-name model trained" in summary, items[-3:]
    assert f"MLflow run id      {run.info.run_id}" in summary
    assert summary.splitlines()[-1].split()[:2] == ["MLflow", "UI"], summary
    assert after == ["Flow run finished successfully in 'Completed'."], after
    finished = [
        i for i in items if i.endswith(f"{flow_run_id[-12:]} Finished in state Completed()")
    ]
    assert len(finished) == 1 and items.index(finished[0]) < len(items) - 1, items[-4:]
    # The progress artifact's updates: one when the epoch starts, one when it is validated,
    # 100 % at the end, and at most one per 30 s besides: no flood of event lines.
    updates = [i for i in items if "prefect.artifact.updated" in i]
    assert 1 <= len(updates) <= 3 + watch_s / 30, (len(updates), watch_s)

    # Read over the API: the `prefect` commands a user types are tested above (deploy,
    # deployment run --watch); a command only to read a record costs a fresh interpreter.
    recorded_run = flow_run(deployed, flow_run_id)
    logs = flow_run_logs(deployed, flow_run_id)
    # By time, too, the summary is the last line: no task's or engine's line after it.
    tail = logs[logs.rindex("ddpflow: pet-name model trained") :]
    assert "Finished in state" not in tail and "MLflow UI" in tail, logs[-3000:]
    recorded = json.dumps(recorded_run) + logs + json.dumps(run.data.params)
    assert deployed["AWS_SECRET_ACCESS_KEY"] not in recorded
    assert deployed["AWS_ACCESS_KEY_ID"] not in recorded

    # The checkpoints and MLflow's copy of the model are objects in the stack's SeaweedFS.
    keys = list_keys(
        deployed["AWS_ENDPOINT_URL_S3"],
        BUCKET,
        key_id=deployed["AWS_ACCESS_KEY_ID"],
        secret=deployed["AWS_SECRET_ACCESS_KEY"],
    )
    run_id = run.info.run_id
    assert any(k.startswith("artifacts/") and run_id in k and "checkpoint" in k for k in keys)
    assert any(k.startswith("mlflow/") and f"{run_id}/artifacts/" in k for k in keys), keys[:20]


def test_retrain_schedule_and_concurrency_limit_are_registered(deployed):
    info = deployment(deployed, RETRAIN)
    schedule = info["schedules"][0]["schedule"]
    assert schedule["cron"] == "0 3 * * *" and schedule["timezone"] == "Europe/Berlin"
    assert info["global_concurrency_limit"]["limit"] == 1
    assert info["concurrency_options"]["collision_strategy"] == "ENQUEUE"


def test_retrain_promotes_only_a_better_challenger(deployed):
    client = MlflowClient(deployed["MLFLOW_TRACKING_URI"])
    name = "ddpflow-charlm-retrain"

    # The runs start as the schedule starts them, through the API (the command line a user
    # types is the first test's and the last's).
    def start(**params: object) -> str:
        return create_flow_run(deployed, RETRAIN, {"training": {"model_name": name, **params}})

    first_run = start(epochs=1, lr=0.01, **TINY)
    # The second once the worker has taken the first, which holds the deployment's slot from
    # Pending on. Made once the first was running (and through the command line, seconds to
    # start), it reached the worker (a poll each 2 s) after the first had ended on a fast
    # machine, and never waited.
    wait_for_state(deployed, first_run, {"PENDING", "RUNNING"}, timeout_s=300)
    worse_run = start(epochs=1, lr=1e-5, **TINY)
    # docs/deployments.md "Concurrency": a retrain that fires while the previous one runs
    # waits (ENQUEUE).
    for run_id in (first_run, worse_run):
        wait_for_state(deployed, run_id, FINAL_STATES, timeout_s=400)
    first_end = flow_run(deployed, first_run)
    assert first_end["state"]["type"] == "COMPLETED", first_end["state"]
    worse_states = state_history(deployed, worse_run)
    names = [s["name"] for s in worse_states]
    assert "AwaitingConcurrencySlot" in names, names
    assert worse_states[-1]["type"] == "COMPLETED", names
    awaited = min(
        _time(s["timestamp"]) for s in worse_states if s["name"] == "AwaitingConcurrencySlot"
    )
    worse_started = min(_time(s["timestamp"]) for s in worse_states if s["type"] == "RUNNING")
    first_ended = _time(first_end["end_time"])
    assert awaited < first_ended <= worse_started, "queued while the first ran, then ran"
    first = client.get_model_version_by_alias(name, "champion").version

    better_run = start(epochs=2, lr=0.01, **TINY)  # twice the first's training: a lower loss
    better_end = wait_for_state(deployed, better_run, FINAL_STATES, timeout_s=400)
    assert better_end["state"]["type"] == "COMPLETED", better_end["state"]
    better = client.get_model_version_by_alias(name, "champion").version
    assert better != first, "a better challenger takes the alias"

    runs = {
        r.data.tags["ddpflow.retrain.challenger_version"]: r
        for r in client.search_runs(
            [client.get_experiment_by_name("ddpflow-charlm").experiment_id],
            filter_string="tags.`ddpflow.role` = 'challenger'",
        )
    }
    assert runs[first].data.tags["prefect.flow_run_id"] == first_run, "promoted, kept"
    assert runs[better].data.tags["ddpflow.retrain.promoted"] == "True"
    worse = next(r for v, r in runs.items() if v not in (first, better))
    assert worse.data.tags["prefect.flow_run_id"] == worse_run
    assert worse.data.tags["ddpflow.retrain.promoted"] == "False"
    assert worse.data.tags["ddpflow.retrain.champion_version"] == first
    challenger_loss = float(worse.data.tags["ddpflow.retrain.challenger_loss"])
    champion_loss = float(worse.data.tags["ddpflow.retrain.champion_loss"])
    assert challenger_loss > champion_loss

    # docs/deployments.md "Retraining": the decision and both scores are a Prefect markdown
    # artifact.
    (decision,) = artifacts(deployed, "charlm-retrain-decision", worse_run)
    markdown = decision["data"]
    assert decision["type"] == "markdown" and "**kept the champion**" in markdown
    version = worse.data.tags["ddpflow.retrain.challenger_version"]
    assert f"| challenger | v{version}: {challenger_loss:.4f} |" in markdown
    assert f"| champion before | v{first}: {champion_loss:.4f} |" in markdown
    assert "| margin | 0 |" in markdown


def test_a_users_own_run_in_flow_flow_deploys_and_runs(stack, tmp_path):
    """examples/prefect.yaml: a flow written against the public API (ddpflow.run_in_flow)
    deploys with `prefect deploy` and trains on the stack's Dask workers when started with
    `prefect deployment run --param`."""
    prefect(stack, "--no-prompt", "deploy", "--prefect-file", "examples/prefect.yaml", "--all")
    output = run_deployment(
        stack, "digits/digits-ddp", epochs=3, checkpoint_root=str(tmp_path / "checkpoints")
    )
    assert "Completed" in output, output[-4000:]
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", output)
    assert run_id, output
    logs = flow_run_logs(stack, run_id.group(1))
    assert re.findall(r"epoch (\d+)/3", logs) == ["1", "2", "3"], logs[-4000:]
    assert float(re.findall(r"held-out accuracy: (\d\.\d+)", logs)[-1]) > 0.5
    (folder,) = (tmp_path / "checkpoints").iterdir()  # the run's own, written by rank 0
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".pt"))
