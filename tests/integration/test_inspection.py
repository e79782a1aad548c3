"""What a user reads after a training, read back through MLflow's and Prefect's APIs and,
with the `browser` marker, in MLflow's UI in headless Chromium.

One short retraining (1 epoch, tiny model, 2 ranks on the LocalCluster the flow starts), run
in the test's process against a real MLflow server and a real Prefect server, is shared by
every test here. A retraining rather than a plain training: it also sets the `champion`
alias, which the model-version page shows.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mlflow.tracking import MlflowClient

from ddpflow.tracking.inspection import (
    TRAINING_VIEW,
    experiment_url,
    model_version_url,
    run_url,
)
from flows.params import RetrainParams
from flows.retrain_charlm import retrain_charlm
from flows.summary import mlflow_ui_hint
from infra.services import free_port, start_mlflow, stop
from tests.helpers.browser import chromium
from tests.helpers.charlm_runs import SMALL_SOURCE
from tests.helpers.in_process import run_in_process
from tests.helpers.paths import CHECKOUT

pytestmark = pytest.mark.integration

MODEL = "ddpflow-charlm"
EXPERIMENT = "ddpflow-charlm"
ONE_EPOCH = {
    "source": SMALL_SOURCE, "epochs": 1, "hidden_size": 32, "num_layers": 1, "batch_size": 1024,
    "lr": 0.01, "num_names": 3, "keep_last": 1,
}  # fmt: skip
# The docs' screenshots are these tests' screenshots. A run writes them to a temporary folder
# unless DDPFLOW_SCREENSHOTS names one: `DDPFLOW_SCREENSHOTS=docs/img make test
# ARGS="-m browser"` refreshes the docs' copies.
SCREENSHOTS_ENV = "DDPFLOW_SCREENSHOTS"


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    chosen = os.environ.get(SCREENSHOTS_ENV)
    return Path(chosen).resolve() if chosen else tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def trained(prefect_api_url, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """The retraining, run in this process on the LocalCluster the flow starts (as a user's
    run without DDPFLOW_DASK_ADDRESS does), with an MLflow server of its own and the run's
    Prefect server (the shared one, this process's API), set as a user sets them."""
    project = tmp_path_factory.mktemp("inspection")
    logs = project / "logs"
    logs.mkdir()
    mlflow_service = start_mlflow(
        free_port(), f"sqlite:///{project / 'mlflow-server.db'}", str(project / "mlartifacts"),
        env={}, log_dir=logs,
    )  # fmt: skip
    try:
        env = {
            "MLFLOW_TRACKING_URI": mlflow_service.url,
            "PREFECT_API_URL": prefect_api_url,
            # A sample a second, so a training of a few seconds has several per rank.
            "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",
        }
        with pytest.MonkeyPatch.context() as patch:
            state = run_in_process(
                retrain_charlm, project, None, patch, env,
                training=RetrainParams(**ONE_EPOCH), return_state=True,
            )  # fmt: skip
        assert state.is_completed(), state
        client = MlflowClient(mlflow_service.url)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        (run,) = client.search_runs([experiment.experiment_id])
        yield {
            "project": project,
            "client": client,
            "mlflow_url": mlflow_service.url,
            "prefect_url": prefect_api_url,
            "experiment": experiment,
            "run": run,
        }
    finally:
        stop(mlflow_service)


def prefect_post(trained: dict[str, Any], path: str, body: dict[str, Any]) -> Any:
    response = httpx.post(f"{trained['prefect_url']}{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def artifact(trained: dict[str, Any], key: str) -> dict[str, Any]:
    """The training's last artifact with `key` (the server also holds other modules' runs)."""
    run_id = trained["run"].data.tags["prefect.flow_run_id"]
    where = {"key": {"any_": [key]}, "flow_run_id": {"any_": [run_id]}}
    found = prefect_post(trained, "/artifacts/filter", {"artifacts": where, "sort": "CREATED_DESC"})
    assert found, f"no artifact {key!r} of flow run {run_id}"
    return found[0]


def flow_run(trained: dict[str, Any]) -> dict[str, Any]:
    run_id = trained["run"].data.tags["prefect.flow_run_id"]
    response = httpx.get(f"{trained['prefect_url']}/flow_runs/{run_id}", timeout=30)
    response.raise_for_status()
    return response.json()


def test_inputs_are_the_files_the_ranks_read_with_their_content_digest(trained):
    inputs = trained["run"].inputs.dataset_inputs
    by_context = {
        next(t.value for t in i.tags if t.key == "mlflow.data.context"): i for i in inputs
    }
    assert set(by_context) == {"training", "validation"}
    for dataset_input in inputs:
        dataset = dataset_input.dataset
        uri = json.loads(dataset.source)["uri"]
        assert uri.startswith(str(trained["project"] / "artifacts")), uri
        content = Path(uri.removeprefix("file://")).read_bytes()
        assert dataset.digest == hashlib.sha256(content).hexdigest()[:32]
        assert json.loads(dataset.profile)["sha256"] == hashlib.sha256(content).hexdigest()
    assert by_context["training"].dataset.digest != by_context["validation"].dataset.digest


def test_system_metrics_have_one_series_per_rank(trained):
    keys = set(trained["run"].data.metrics)
    for rank in (0, 1):
        assert f"system/rank{rank}/cpu_utilization_percentage" in keys, sorted(keys)
        assert f"system/rank{rank}/system_memory_usage_megabytes" in keys, sorted(keys)


def test_run_is_named_and_described_after_its_flow_run_and_commit(trained):
    run = trained["run"]
    prefect_run = flow_run(trained)
    assert run.info.run_name == prefect_run["name"]
    note = run.data.tags["mlflow.note.content"]
    ui = trained["prefect_url"].removesuffix("/api")
    assert f"{ui}/runs/flow-run/{prefect_run['id']}" in note
    head = subprocess.run(
        ["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert head in note
    assert run.data.tags["mlflow.source.git.commit"].startswith(head)
    assert run.data.tags["mlflow.source.name"] == "retrain-charlm"
    for dataset_input in run.inputs.dataset_inputs:
        assert dataset_input.dataset.digest in note


def test_registered_version_says_what_it_is_on_which_data_and_how_good(trained):
    client, run = trained["client"], trained["run"]
    (version,) = client.search_model_versions(f"name='{MODEL}'")
    digests = {i.dataset.digest for i in run.inputs.dataset_inputs}
    loss = run.data.metrics["final_val_loss"]
    assert all(d in version.description for d in digests), version.description
    assert f"{loss:.4f}" in version.description
    assert version.tags["ddpflow.workload"] == "charlm"
    assert version.tags["metric.final_val_loss"] == f"{loss:.4f}"
    assert version.tags["data.training.digest"] in digests
    run_link = version.tags["ddpflow.run_link"]
    assert run_link == (
        f"{trained['mlflow_url']}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        f"{TRAINING_VIEW}"
    )
    assert httpx.get(trained["mlflow_url"], timeout=30).status_code == 200
    # The first retraining has no champion to face: it is promoted, and says so.
    assert client.get_registered_model(MODEL).aliases == {"champion": version.version}
    assert version.tags["ddpflow.retrain.promoted"] == "True"
    assert version.tags["ddpflow.retrain.role"] == "challenger"


def test_experiment_opens_in_the_model_training_view(trained):
    assert trained["experiment"].tags["mlflow.experimentKind"] == "custom_model_development"


def test_prefect_shows_progress_at_100_percent_with_the_loss(trained):
    progress = artifact(trained, "charlm-progress")
    assert progress["type"] == "progress"
    assert float(progress["data"]) == 100.0
    assert "train loss" in progress["description"], progress["description"]
    assert progress["flow_run_id"] == trained["run"].data.tags["prefect.flow_run_id"]


def test_prefect_links_the_mlflow_run_and_version_and_tags_the_workload(trained):
    run = trained["run"]
    links = artifact(trained, "charlm-mlflow")["data"]
    base = trained["mlflow_url"]
    assert f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}" in links
    assert f"{base}/#/models/{MODEL}/versions/1" in links
    assert "workload:charlm" in flow_run(trained)["tags"]


# ---- the MLflow UI in a real browser -------------------------------------------------------


def render(url: str, screenshot: Path | None = None, budget_ms: int = 20000) -> str:
    """The DOM of `url` after the page's scripts ran for `budget_ms` of virtual time, in a
    fresh browser profile (which MLflow's UI opens in its GenAI mode unless the link says
    otherwise: ddpflow's links do)."""
    base = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--window-size=1400,1000", f"--virtual-time-budget={budget_ms}",
    ]  # fmt: skip
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [*base, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True
        )
    done = subprocess.run(
        [*base, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout


@pytest.mark.browser
def test_run_page_shows_the_datasets(trained, screenshots):
    run = trained["run"]
    url = run_url(trained["mlflow_url"], run.info.experiment_id, run.info.run_id)
    dom = render(url, screenshots / "mlflow-run.png")
    assert "pet-names-train" in dom
    assert run.info.run_name in dom
    assert trained["run"].data.tags["mlflow.source.git.commit"][:7] in dom


@pytest.mark.browser
def test_system_metrics_tab_shows_a_chart_per_rank(trained, screenshots):
    run = trained["run"]
    url = (
        f"{trained['mlflow_url']}/#/experiments/{run.info.experiment_id}/runs/"
        f"{run.info.run_id}/system-metrics{TRAINING_VIEW}"
    )
    dom = render(url, screenshots / "mlflow-system-metrics.png")
    # The tab groups the charts by prefix, one section per rank: "system/rank0 (8)".
    for rank in (0, 1):
        charts = re.search(rf"system/rank{rank}\s*(?:<[^>]*>\s*)*\((\d+)\)", dom)
        assert charts is not None and int(charts.group(1)) >= 3, dom[-3000:]


@pytest.mark.browser
def test_model_version_page_shows_the_alias_and_description(trained, screenshots):
    url = model_version_url(trained["mlflow_url"], MODEL, "1")
    dom = render(url, screenshots / "mlflow-model-version.png")
    assert "champion" in dom
    assert "final_val_loss" in dom


@pytest.mark.browser
def test_the_links_ddpflow_gives_open_the_training_view(trained, screenshots):
    run = trained["run"]
    link = mlflow_ui_hint(
        trained["mlflow_url"], run.info.run_id, run.info.experiment_id
    ).removeprefix("open ")
    dom = render(link)
    assert run.info.run_name in dom and "Model metrics" in dom, dom[-3000:]
    links = artifact(trained, "charlm-mlflow")["data"]
    experiment = experiment_url(trained["mlflow_url"], run.info.experiment_id)
    assert experiment in links
    dom = render(experiment, screenshots / "mlflow-experiment.png")
    assert run.info.run_name in dom and "Run Name" in dom, "the runs table"
    assert "Detect Issues" not in dom, dom[-3000:]
    # What the query is for: a fresh browser opens the bare experiment on GenAI's overview.
    assert "Detect Issues" in render(experiment.removesuffix(TRAINING_VIEW))
