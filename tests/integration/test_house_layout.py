"""The shape of the house, checked with the real tools: import-linter's contracts and a built
wheel. (Both start processes, so they live here rather than in tests/unit.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import REPO


def test_the_import_contracts_hold():
    """pyproject.toml's import-linter contracts: the library (ddpflow/) never imports
    prefect, flows or tasks, tasks never imports flows, and the library's concerns import
    downwards only (README "Layout"), so the library runs on Dask workers and in plain
    scripts without an orchestrator and a task or library module can be reused without the
    built-in flows. `make test` runs the same check first."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_the_wheel_ships_only_the_library(tmp_path: Path):
    """A wheel built from pyproject.toml holds exactly one top-level package, `ddpflow`:
    flows/, tasks/ and infra/ are the project's application code, run from the checkout, so
    installing ddpflow never puts a generic `flows` or `tasks` into site-packages. Builds
    the real wheel (no dependencies, no network)."""
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
    assert tops == {"ddpflow"}, sorted(tops)
    assert "ddpflow/workloads/charlm/data/" in "".join(names), "the package data ships too"
