"""Promises about the code's shape that a refactor could silently break."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from ddpflow.workloads.vision.training import make_optimizer
from tests.helpers.paths import CHECKOUT

SECRET_KEYS = re.compile(r"(secret|password|token|access_key|auth)", re.IGNORECASE)
SECRET_VALUES = re.compile(r"(AKIA[0-9A-Z]{12,}|://[^/\s:@]+:[^/\s@]+@)")


def _walk(value: object, path: str = "") -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _walk(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [item for i, v in enumerate(value) for item in _walk(v, f"{path}[{i}]")]
    return [(path, value)]


def test_the_deployment_file_holds_no_secret():
    # docs/deployments.md: no secret is in deployments/prefect.yaml; the worker's own
    # environment supplies tracking URI, artifact root and AWS settings.
    spec = yaml.safe_load((CHECKOUT / "deployments" / "prefect.yaml").read_text())
    leaves = _walk(spec)
    assert len(leaves) > 10, "the file was parsed"
    keyed = [path for path, _ in leaves if SECRET_KEYS.search(path.rsplit(".", 1)[-1])]
    valued = [path for path, value in leaves if SECRET_VALUES.search(str(value))]
    assert keyed == [] and valued == []
    assert not any("job_variables" in path and ".env" in path for path, _ in leaves), (
        "no environment is set per deployment"
    )


@pytest.mark.parametrize(("kind", "cls"), [("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)])
def test_the_image_optimizer_is_the_one_asked_for(kind, cls):
    # docs/images.md: Adam, or `--optimizer sgd` (with momentum 0.9).
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = make_optimizer(kind, params, lr=0.5)
    assert type(optimizer) is cls and optimizer.param_groups[0]["lr"] == 0.5
    if kind == "sgd":
        assert optimizer.param_groups[0]["momentum"] == 0.9
    # Fused where the rank's device has the kernels (TrainSpeed.fused_optimizer); not fused
    # leaves torch its own choice (None), not an explicit False.
    assert make_optimizer(kind, params, lr=0.5, fused=True).param_groups[0]["fused"] is True
    assert optimizer.param_groups[0]["fused"] is None


def test_an_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match=r"optimizer='lamb' is not one of adam, sgd"):
        make_optimizer("lamb", [torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_tasks_take_their_settings_from_the_flow():
    """ddpflow.config reads the environment once, in the flow; the tasks get what they need
    (LaunchSettings, SweepSetup.rank_resources) passed down and never read it again."""
    readers = [
        str(path.relative_to(CHECKOUT))
        for path in sorted((CHECKOUT / "tasks").glob("*.py"))
        if "from_env(" in path.read_text() or "os.environ" in path.read_text()
    ]
    assert readers == []
