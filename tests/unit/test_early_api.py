"""When a flow's command line starts its embedded Prefect API early (ddpflow_flows/early_api.py)."""

from __future__ import annotations

import pytest

from ddpflow_flows.early_api import wanted

PY = "/usr/bin/python3"


@pytest.mark.parametrize(
    "argv",
    [
        [PY, "-m", "ddpflow_flows.train_charlm", "--epochs", "1"],
        [PY, "-u", "-m", "ddpflow_flows.train_images"],
        [PY, "-m", "ddpflow_flows.sweep_charlm", "--grid", "{}"],
        [PY, "-m", "ddpflow_flows.retrain_charlm"],
        [PY, "-m", "ddpflow_flows.scaling_charlm", "--world-sizes", "1,2"],
        [PY, "-m", "ddpflow_flows.scaling_images"],
    ],
)
def test_a_flow_command_line_without_an_api_starts_one_early(argv):
    assert wanted(argv, {})


@pytest.mark.parametrize(
    "argv, environ",
    [
        ([PY, "-m", "ddpflow_flows.train_charlm"], {"PREFECT_API_URL": "http://api:4200/api"}),
        ([PY, "-m", "ddpflow_flows.train_charlm", "--help"], {}),
        ([PY, "-m", "ddpflow_flows.params"], {}),
        ([PY, "-m", "pytest", "tests"], {}),
        ([PY, "script.py", "-m", "ddpflow_flows.train_charlm"], {}),
        ([PY, "-c", "import ddpflow_flows"], {}),
        ([PY, "-m"], {}),
    ],
)
def test_anything_else_starts_nothing(argv, environ):
    assert not wanted(argv, environ)
