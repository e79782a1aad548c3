"""A restart inside a user's Prefect flow, for real: `python -m tests.helpers.api_flows`
runs a flow whose training loses a worker process to a real SIGKILL mid-run, on the
LocalCluster its DaskTaskRunner starts, with its own Prefect home. Nothing is mocked."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers.projects import prefect_records, run_in_project

pytestmark = pytest.mark.integration


# docs/api.md "In a Prefect flow": each restart is a WARNING of the ddp-train task's log,
# with its cause, and the flow still completes. docs/inspecting.md "Progress": the
# training's one progress artifact follows it across the restart.
def test_a_restart_in_a_flow_is_logged_by_the_task(tmp_path):
    result = run_in_project([sys.executable, "-m", "tests.helpers.api_flows"], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "killed 1 worker(s); held-out accuracy: 0.9" in output, output[-4000:]
    warnings = re.findall(
        r"WARNING \| Task run 'ddp-train-\w+' - DDP group restart (\d) \(world size 2\): (.*)",
        output,
    )
    assert [attempt for attempt, _ in warnings] == ["1"], output[-4000:]
    assert "its worker left the cluster" in warnings[0][1], warnings
    # One progress artifact for the training, made before the restart and fed by both
    # attempts' events: it ends at 100 % with the last epoch, which only the relaunch reached.
    (progress,) = [
        a for a in prefect_records(tmp_path)["artifacts"] if a["key"] == "ddp-train-progress"
    ]
    assert float(progress["data"]) == 100.0, progress
    assert progress["description"] == "DDP training: done, epoch 6/6, step 6/6 (100 %)", progress
