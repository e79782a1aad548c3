"""Promises about the code's shape that a refactor could silently break."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ddpflow.vision.training import make_optimizer
from tests.integration.conftest import REPO


def test_the_import_contracts_hold():
    """pyproject.toml's import-linter contracts: the library (ddpflow/) never imports
    prefect, ddpflow_flows or ddpflow_tasks, and ddpflow_tasks never imports ddpflow_flows
    (README "Layout"), so the library runs on Dask workers and in plain scripts without an
    orchestrator and a task or library module can be reused without the built-in flows.
    `make test` runs the same check first."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_every_installed_top_level_package_is_ddpflows_own(tmp_path: Path):
    """A wheel built from pyproject.toml puts only `ddpflow`-prefixed packages at the top of
    site-packages, so installing ddpflow never shadows (or is shadowed by) another project's
    `flows`, `tasks` or `infra`. Builds the real wheel (no dependencies, no network)."""
    import shutil
    import zipfile

    # A copy of the tracked tree, so the build's scratch folders never land in the checkout.
    source = tmp_path / "source"
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in tracked:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*command, "-q", "-w", str(wheels), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("ddpflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops >= {"ddpflow", "ddpflow_flows", "ddpflow_tasks", "ddpflow_infra"}, tops
    assert all(t.startswith("ddpflow") for t in tops), sorted(tops)


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
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
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


def test_an_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match=r"optimizer='lamb' is not one of adam, sgd"):
        make_optimizer("lamb", [torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_tasks_take_their_settings_from_the_flow():
    """ddpflow.config reads the environment once, in the flow; the tasks get what they need
    (LaunchSettings, SweepSetup.rank_resources) passed down and never read it again."""
    readers = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "ddpflow_tasks").glob("*.py"))
        if "from_env(" in path.read_text() or "os.environ" in path.read_text()
    ]
    assert readers == []
