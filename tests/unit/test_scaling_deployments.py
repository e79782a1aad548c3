"""The scaling deployments in deployments/prefect.yaml name real flows and real parameters."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("deployment", "flow_name"),
    [("charlm-scaling", "scaling-charlm"), ("images-scaling", "scaling-images")],
)
def test_a_scaling_deployment_runs_its_flow_with_known_parameters(deployment, flow_name):
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (entry,) = [d for d in spec["deployments"] if d["name"] == deployment]
    path, function = entry["entrypoint"].split(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    flow = getattr(module, function)
    assert flow.name == flow_name
    assert set(entry["parameters"]) <= set(inspect.signature(flow.fn).parameters)
    assert entry["work_pool"]["name"] == "ddpflow-pool"
