"""The pet-name flow end to end: Prefect + LocalCluster (2 worker processes) + gloo + MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch

from ddpflow import storage
from ddpflow.checkpoint.store import CheckpointStore
from ddpflow.distributed.planning import PlanError
from ddpflow.integrations.prefect import db_template as prefect_db_template
from ddpflow.integrations.prefect import early_cluster
from ddpflow.tracking.store import template as mlflow_store_template
from flows.params import CharLMParams
from flows.train_charlm import train_charlm
from tests.helpers.charlm_runs import SMALL_SOURCE
from tests.helpers.in_process import run_in_process
from tests.helpers.prefect_reads import completed_task_runs, flow_run_logs
from tests.helpers.projects import (
    prefect_cli,
    prefect_records,
    project_tracking,
    run_flow,
    tiny_charlm,
)

pytestmark = pytest.mark.integration

EPOCHS = 3
SMALL = {"hidden_size": 32, "batch_size": 1024, "lr": 0.01, "keep_last": 2, "num_names": 10}
# The first run reads the shipped corpus, as `make demo` does (no --source), and so does the
# rerun that reuses its data.
TINY = tiny_charlm(EPOCHS, source=None, **SMALL)
# TINY as the flow's parameter model takes it (tiny_charlm's sizes).
SMALL_PARAMS = {"epochs": EPOCHS, "hidden_size": 16, "num_layers": 1, "batch_size": 4096, **SMALL}

# Loads the registered model where ddpflow cannot be imported (any import of the project's
# packages raises, the editable install included) and generates a name with nothing but
# torch and the 31-symbol alphabet docs/charlm.md documents.
FRESH_LOAD = """
import importlib.abc, json, sys

class NoProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tests" or name.startswith("ddpflow"):
            raise ModuleNotFoundError(f"{name} is not importable here")
        return None

sys.meta_path.insert(0, NoProject())
import mlflow, torch

CHARACTERS = "*+abcdefghijklmnopqrstuvwxyz-. "  # 0 pads a context, 1 ends a name
model = mlflow.pytorch.load_model(sys.argv[1])
context, name = [0] * 8, ""
with torch.no_grad():
    logits = model(torch.zeros((3, 8), dtype=torch.long))
    while len(name) < 30:
        last = model(torch.tensor([context, context]))[0, -1]
        last[0] = float("-inf")
        if not name:
            last[1] = float("-inf")  # at least one character
        index = int(last.argmax())
        if index == 1:
            break
        name, context = name + CHARACTERS[index], context[1:] + [index]
print(json.dumps({"name": name, "logits": logits.tolist(),
                  "project_modules": [m for m in sys.modules if m.startswith("ddpflow")]}))
"""


def data_files(artifacts: Path) -> dict[str, tuple[int, int]]:
    """Every downloaded and formatted file with its size and modification time."""
    return {
        str(p.relative_to(artifacts)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in (artifacts / "data").rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    project = tmp_path_factory.mktemp("charlm")
    # The speed settings reach the ranks: pinning is asked for, and is a no-op on CPU.
    # A first project: no Prefect home and no MLflow store yet, as a user's.
    result = run_flow(
        "train_charlm",
        [*TINY, "--pin-memory", "true", "--precision", "auto"],
        project,
        first_project=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    client = project_tracking(project)
    experiment = client.get_experiment_by_name("ddpflow-charlm")
    runs = client.search_runs([experiment.experiment_id])
    return {
        "project": project,
        "stdout": result.stdout + result.stderr,
        "client": client,
        "experiment": experiment,
        "runs": runs,
    }


# docs/charlm.md: the workers exit by themselves when the flow closes its cluster (the nanny
# kills one that is still there after its 4 s close timeout, and says so).
def test_the_flows_workers_exit_without_being_killed(trained):
    assert "still alive after" not in trained["stdout"], trained["stdout"][-3000:]


# docs/s3-and-servers.md: a flow's command line starts its LocalCluster while the embedded
# API starts, and the flow's task runner takes that cluster instead of starting another.
def test_the_flow_runs_on_the_cluster_started_beside_its_embedded_api(trained):
    assert early_cluster.ADOPTED in trained["stdout"], trained["stdout"][-3000:]
    # ...and says only that: not prefect-dask's "Creating a new Dask cluster" before it.
    assert "Creating a new Dask cluster" not in trained["stdout"]


# docs/s3-and-servers.md: a project's first flow starts its embedded API on a copy of the
# migrated database `make venv` built, and Prefect keeps the flow run in that copy.
def test_the_first_embedded_api_starts_on_the_installed_database_template(trained):
    installed = prefect_db_template.template_path()
    assert installed is not None and installed.is_file(), f"make venv builds {installed}"
    copied = trained["project"] / ".prefect" / "prefect.db"
    assert f"{prefect_db_template.SEEDED_FROM} to {copied}" in trained["stdout"], trained["stdout"][
        -3000:
    ]
    runs = prefect_records(trained["project"])["flow_runs"]
    assert [r["state_type"] for r in runs] == ["COMPLETED"], runs


# docs/s3-and-servers.md: a project's first run creates its MLflow store from the migrated
# schema `make venv` built (MLflow logs the line below when it migrates a new store instead),
# and MLflow adds its Default experiment where it would have on a store it made itself.
def test_the_first_mlflow_store_is_a_copy_of_the_installed_template(trained):
    installed = mlflow_store_template.template_path()
    assert installed is not None and installed.is_file(), f"make venv builds {installed}"
    assert "Creating initial MLflow database tables" not in trained["stdout"], trained["stdout"][
        -3000:
    ]
    default = trained["client"].get_experiment("0")
    assert default.name == "Default"
    assert default.artifact_location == str(trained["project"] / "mlruns" / "0")


def test_exactly_one_mlflow_run_with_params_and_flow_run_tag(trained):
    runs = trained["runs"]
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    for key in (
        "epochs",
        "batch_size",
        "lr",
        "hidden_size",
        "num_layers",
        "seed",
        "world_size",
        "data_sha256",
    ):
        assert key in run.data.params, key
    assert run.data.params["world_size"] == "2"
    assert (run.data.params["precision"], run.data.params["pin_memory"]) == ("auto", "True")
    # What ran, resolved on the CPU ranks: docs/charlm.md "Speed settings".
    resolved = json.loads(run.data.tags["ddpflow.speed"])
    assert resolved == {
        "precision": "fp32",
        "channels_last": False,
        "pin_memory": False,
        "tf32": False,
        "compile": False,
        "fused_optimizer": True,
    }
    assert "pin_memory: no CUDA device, so nothing is pinned" in trained["stdout"]
    assert run.data.tags["prefect.flow_run_id"]
    assert trained["experiment"].tags["mlflow.experimentKind"] == "custom_model_development"


def test_each_epoch_metric_logged_once_and_loss_falls(trained):
    run_id = trained["runs"][0].info.run_id
    client = trained["client"]
    for key in ("val_loss", "epoch_train_loss", "epoch_time_s", "epoch_samples_per_s"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == list(range(1, EPOCHS + 1)), (key, steps)
    val = [
        m.value for m in sorted(client.get_metric_history(run_id, "val_loss"), key=lambda m: m.step)
    ]
    assert val[-1] < val[0], val
    train_steps = sorted(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)
    assert len(train_steps) >= 3, "per-step loss is logged while training"
    assert train_steps[-1].value < train_steps[0].value


def test_checkpoints_load_with_weights_only_and_hold_the_last_epoch(trained):
    run_id = trained["runs"][0].info.run_id
    root = storage.join(str(trained["project"] / "artifacts"), "runs", run_id, "checkpoints")
    store = CheckpointStore(root)
    assert store.latest_uri().endswith(f"epoch-{EPOCHS:04d}.pt")
    assert len(store.list_uris()) == 2, "keep_last=2 prunes older checkpoints"
    state = torch.load(store.latest_uri(), weights_only=True)
    assert state["epoch"] == EPOCHS
    assert state["model_config"]["hidden_size"] == 32
    assert "optimizer_state" in state
    artifacts = [a.path for a in trained["client"].list_artifacts(run_id, "checkpoints")]
    kept = [f"checkpoints/{uri.rsplit('/', 1)[-1]}" for uri in store.list_uris()]
    assert artifacts == kept, "MLflow holds the same keep_last=2 checkpoints as the store"
    assert "(2 kept, " in trained["stdout"], "the summary says what is kept"
    # MLflow's copies live under the artifact root, not in a folder of the working directory
    # (the project folder here: the flow ran in it, as a user runs `make demo`).
    mlflow_copies = (trained["project"] / "artifacts" / "mlflow").as_uri()
    assert trained["runs"][0].info.artifact_uri.startswith(mlflow_copies)
    left = sorted(p.name for p in trained["project"].iterdir())
    # The store's file and its lock (ddpflow.tracking.store) are what MLFLOW_TRACKING_URI names.
    assert left == [".prefect", "artifacts", "mlflow.db", "mlflow.db.lock"], left


def test_model_registered_and_serves_logits(trained):
    client = trained["client"]
    versions = client.search_model_versions("name='ddpflow-charlm'")
    assert [v.run_id for v in versions] == [trained["runs"][0].info.run_id]
    mlflow.set_tracking_uri(client.tracking_uri)
    model = mlflow.pytorch.load_model("models:/ddpflow-charlm/1")
    logits = model(torch.zeros((3, 8), dtype=torch.long))
    assert tuple(logits.shape) == (3, 8, 31)


def test_summary_prints_run_names_checkpoints_and_ui_command(trained):
    out = trained["stdout"]
    run_id = trained["runs"][0].info.run_id
    assert f"MLflow run id      {run_id}" in out
    names_line = next(line for line in out.splitlines() if "generated names" in line)
    names = names_line.split("generated names", 1)[1].strip().split(", ")
    assert len(names) == 10 and any(n != "(empty)" for n in names)
    assert "mlflow ui --backend-store-uri sqlite:///" in out
    # Rank 0's progress reaches the flow's log, once per epoch.
    done = [line for line in out.splitlines() if "done: train loss" in line]
    assert [line.split("epoch ")[1][:3] for line in done] == [f"{e}/{EPOCHS}" for e in (1, 2, 3)]
    assert all("train-ddp" in line and "samples/s" in line for line in done), done
    text = trained["client"].download_artifacts(run_id, "evaluation/generated_names.txt")
    assert len(Path(text).read_text().split("\n")) >= 10


# docs/charlm.md "What make demo does": a rerun finds the downloaded copy and the formatted tensors.
def test_rerun_reuses_downloaded_and_formatted_data(trained, flow_services, monkeypatch, tmp_path):
    artifacts = trained["project"] / "artifacts"
    before = data_files(artifacts)
    raw, formatted = (
        list((artifacts / "data" / "raw").iterdir()),
        list((artifacts / "data" / "formatted").iterdir()),
    )
    assert len(raw) == 1 and len(formatted) == 1
    manifest = json.loads((formatted[0] / "manifest.json").read_text())
    assert manifest["num_train_samples"] > 100_000
    assert "reused)" not in trained["stdout"], "the first run did the work"
    # The same artifact store; a Prefect and MLflow store of its own, so the first run's
    # records (one run, model version 1) stay as the other tests read them.
    env = {"DDPFLOW_ARTIFACT_ROOT": str(artifacts)}
    training = CharLMParams(**{**SMALL_PARAMS, "epochs": 1})
    state = run_in_process(
        train_charlm, tmp_path, flow_services, monkeypatch, env, training=training,
        return_state=True,
    )  # fmt: skip
    assert state.is_completed(), state
    output = flow_run_logs(state.state_details.flow_run_id, "reused)")
    assert "(raw copy and tensors reused)" in output, output[-5000:]
    assert data_files(artifacts) == before, "nothing was downloaded or formatted again"


# docs/charlm.md "What make demo does" (register): loading the model needs no ddpflow code.
def test_registered_model_loads_and_generates_a_name_without_ddpflow(trained, tmp_path):
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "MLFLOW_TRACKING_URI": trained["client"].tracking_uri,
    }  # no PYTHONPATH, run from a folder outside the repository
    result = subprocess.run(
        [sys.executable, "-c", FRESH_LOAD, "models:/ddpflow-charlm/1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["project_modules"] == []
    assert loaded["name"] and set(loaded["name"]) <= set("abcdefghijklmnopqrstuvwxyz-. ")
    mlflow.set_tracking_uri(trained["client"].tracking_uri)
    here = mlflow.pytorch.load_model("models:/ddpflow-charlm/1")
    expected = here(torch.zeros((3, 8), dtype=torch.long))
    torch.testing.assert_close(torch.tensor(loaded["logits"]), expected.detach())


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "does not exist"), ("{not json", "not valid JSON"), ('{"a": 1}', "list")],
)
def test_bad_source_fails_fast_naming_the_source(
    tmp_path, content, expected, flow_services, monkeypatch
):
    source = tmp_path / "names.json"
    if content is not None:
        source.write_text(content)
    project = tmp_path / "project"
    training = CharLMParams(source=str(source), epochs=EPOCHS, hidden_size=16, num_layers=1)
    with pytest.raises(Exception) as failed:  # noqa: PT011 - the message is what is checked
        run_in_process(train_charlm, project, flow_services, monkeypatch, training=training)
    assert str(source) in str(failed.value) and expected in str(failed.value), failed.value
    assert not (project / "artifacts" / "data").exists(), "nothing is written"


def test_world_size_larger_than_cluster_fails_before_any_work(flow_services, monkeypatch, tmp_path):
    training = CharLMParams(**SMALL_PARAMS, world_size=3)
    with pytest.raises(PlanError) as failed:
        run_in_process(train_charlm, tmp_path, flow_services, monkeypatch, training=training)
    assert "world_size=3" in str(failed.value) and "DDPFLOW_DASK_WORKERS" in str(failed.value)
    assert not (tmp_path / "artifacts").exists()


# docs/inspecting.md: `prefect artifact inspect KEY` shows an artifact of the project's runs.
def test_evaluation_is_a_prefect_markdown_artifact(trained):
    result = prefect_cli(trained["project"], "artifact", "inspect", "charlm-evaluation")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Pet-name model evaluation" in result.stdout
    assert trained["runs"][0].info.run_id in result.stdout


# docs/data.md: with --data-layout shards the names are formatted by one task per chunk on
# the cluster's workers, and the ranks, the evaluation and the registration read the shards.
def test_a_sharded_corpus_is_formatted_on_the_workers_and_streamed(
    flow_services, monkeypatch, tmp_path
):
    training = CharLMParams(
        **SMALL_PARAMS, source=SMALL_SOURCE, data_layout="shards", shard_mb=0.1, world_size=2
    )
    state = run_in_process(
        train_charlm, tmp_path / "project", flow_services, monkeypatch, training=training,
        return_state=True,
    )  # fmt: skip
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    output = flow_run_logs(flow_run_id, "registered model")
    shards = list((tmp_path / "project" / "artifacts" / "data" / "corpus-shards").glob("shards/*"))
    chunk_runs = [n for n in completed_task_runs(flow_run_id) if n.startswith("format-name-chunk-")]
    assert len(shards) == len(chunk_runs) >= 4, (shards, chunk_runs)
    assert "streamed from shards" in output, output[-5000:]
    client = project_tracking(tmp_path / "project")
    (run,) = client.search_runs([client.get_experiment_by_name("ddpflow-charlm").experiment_id])
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert len(losses) == EPOCHS and losses[-1] < losses[0], losses
    assert run.data.params["data_layout"] == "shards"
    assert "registered model   version 1" in output, output[-5000:]
