"""The image sweep end to end: sweep-images on the digits demo, a 2-worker LocalCluster.

A search with the grid sampler over a frozen and a trainable backbone (two points, one
epoch each at 32 px, the two trials at once): every point runs once with n_trials unset,
each trial is a child run of the image training's metrics, and the best trial's model is
registered. The flow runs in the test's process on the module's flow_services.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from flows.params import ImageSweepParams
from flows.sweep_images import sweep_images
from tests.helpers.in_process import run_in_process
from tests.helpers.prefect_reads import flow_run_logs, flow_run_records

pytestmark = pytest.mark.integration

EXPERIMENT = "images-sweep-test"
MODEL = "images-sweep-test-model"
SPACE = {"freeze_backbone": {"choices": [True, False]}}


@pytest.fixture(scope="module")
def swept(flow_services, tmp_path_factory) -> dict[str, Any]:
    project = tmp_path_factory.mktemp("images-sweep")
    params = ImageSweepParams(
        search=SPACE,
        sampler="grid",
        pruner="none",
        epochs=1,
        image_size=16,  # what is tested is the sweep, not how well a trial learns
        batch_size=64,
        lr=0.003,
        experiment=EXPERIMENT,
        model_name=MODEL,
    )
    with pytest.MonkeyPatch.context() as patch:
        state = run_in_process(
            sweep_images, project, flow_services, patch, sweep=params, return_state=True
        )
    assert state.is_completed(), state
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    flow_run_id = state.state_details.flow_run_id
    return {
        "client": client,
        "parent": parent,
        "children": [r for r in runs if "mlflow.parentRunId" in r.data.tags],
        "flow_run_id": flow_run_id,
        "out": flow_run_logs(flow_run_id, "ddpflow: sweep"),
    }


def test_every_grid_point_is_an_image_trial_with_its_child_run(swept) -> None:
    parent, children = swept["parent"], swept["children"]
    assert parent.data.tags["ddpflow.workload"] == "images-sweep"
    assert json.loads(parent.data.params["search"]) == SPACE
    assert sorted(c.data.params["freeze_backbone"] for c in children) == ["False", "True"]
    client = swept["client"]
    for child in children:
        assert child.data.tags["ddpflow.workload"] == "images-trial"
        assert child.data.tags["ddpflow.trial_state"] == "COMPLETE"
        assert child.info.status == "FINISHED"
        history = client.get_metric_history(child.info.run_id, "val_accuracy")
        assert [m.step for m in history] == [1], "the image training's own metrics"
        assert "final_val_loss" in child.data.metrics
    assert parent.data.metrics["trial_epochs"] == 2


def test_the_best_image_trial_is_registered_and_ranked_in_prefect(swept) -> None:
    client, parent, children = swept["client"], swept["parent"], swept["children"]
    best = min(children, key=lambda c: c.data.metrics["final_val_loss"])
    assert parent.data.tags["ddpflow.best_run_id"] == best.info.run_id
    versions = client.search_model_versions(f"name='{MODEL}'")
    assert [v.run_id for v in versions] == [best.info.run_id]
    artifacts = {a["key"]: a for a in flow_run_records(swept["flow_run_id"])["artifacts"]}
    table = artifacts["images-sweep"]
    rows = table["data"] if isinstance(table["data"], list) else json.loads(table["data"])
    assert rows[0]["run_id"] == best.info.run_id and rows[0]["state"] == "COMPLETE"
    assert artifacts["images-search-progress"]["data"] == 100.0
    assert "freeze_backbone" in swept["out"]  # the summary's table has the image columns
