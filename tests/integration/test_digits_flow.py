"""A user's own Prefect flow around the public API, run the way a user runs it: `python -m
examples.digits_flow` in a subprocess with its own Prefect home and MLflow store, on a real
LocalCluster that the flow's DaskTaskRunner starts. Nothing is mocked."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers.projects import prefect_records, project_tracking, run_in_project

pytestmark = pytest.mark.integration


# docs/api.md "In a Prefect flow": ddpflow.run_in_flow() trains on the flow's own Dask
# cluster, its ctx.report() lines are in the flow run's log, ddpflow.fit's steps are the
# task's progress artifact, and its result is rank 0's.
def test_the_digits_flow_trains_on_the_flows_cluster(tmp_path):
    result = run_in_project([sys.executable, "-m", "examples.digits_flow"], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    accuracy = float(re.findall(r"held-out accuracy: (\d\.\d+)", output)[-1])
    assert accuracy >= 0.9
    # The progress lines are logged by the task run, each epoch once.
    epochs = re.findall(r"Task run 'ddp-train-\w+' - epoch (\d+)/20", output)
    assert epochs == [str(e) for e in range(1, 21)], output[-4000:]
    client = project_tracking(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_accuracy"] == pytest.approx(accuracy, abs=5e-4)
    assert run.data.params == {"epochs": "20", "lr": "0.05"}
    # ddpflow.fit's steps reach the task's progress artifact, which ends at 100 %.
    (progress,) = [
        a for a in prefect_records(tmp_path)["artifacts"] if a["key"] == "ddp-train-progress"
    ]
    assert progress["type"] == "progress" and float(progress["data"]) == 100.0, progress
    assert "DDP training: done, epoch 20/20" in progress["description"], progress
    # Both come from one stream of progress events: the artifact's last losses are those of
    # the last epoch's log line, which was the same event.
    losses = r"train loss (\d+\.\d+), val loss (\d+\.\d+)"
    logged = re.findall(r"epoch 20/20 done: " + losses, output)
    assert logged and re.findall(losses, progress["description"]) == logged[-1:], progress
