"""The shape of the house, checked with the real tools: a built wheel, and that wheel
installed without extras into a new virtual environment, where it
trains. (All start processes, so they live here rather than in tests/unit.)"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.paths import CHECKOUT

LIBRARY = CHECKOUT / "ddpflow"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def library_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel pyproject.toml builds from the working tree (no dependencies, no network),
    built once for the module's tests."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    # A copy of the tree, so the build's scratch folders never land in the checkout: the
    # tracked files and the new ones git would add (untracked, not ignored), so a module
    # not committed yet still ships, as it will.
    source = tmp_path / "source"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (CHECKOUT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CHECKOUT / name, source / name)
    wheels = tmp_path / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*command, "-q", "-w", str(wheels), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("ddpflow-*.whl")
    return wheel


def test_the_wheel_ships_only_the_library(library_wheel: Path):
    """A wheel built from pyproject.toml holds exactly one top-level package, `ddpflow`:
    flows/, tasks/ and infra/ are the project's application code, run from the checkout, so
    installing ddpflow never puts a generic `flows` or `tasks` into site-packages."""
    names = zipfile.ZipFile(library_wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ddpflow"}, sorted(tops)
    assert "ddpflow/workloads/charlm/data/" in "".join(names), "the package data ships too"
    assert "ddpflow/py.typed" in names, "type checkers read the library's hints (PEP 561)"


# The extras' distributions: Prefect and Optuna (the flows extra), MLflow's server (server),
# matplotlib (plots), scikit-learn (digits). wheel_venv_training.OPTIONAL names their import
# names.
EXTRAS_DISTRIBUTIONS = {
    "prefect",
    "prefect-dask",
    "optuna",
    "mlflow",
    "matplotlib",
    "scikit-learn",
}
# The library's parts that need one (tests/helpers/wheel_venv_training.py calls each).
NEEDS = {
    "sweep plots": "plots",
    "scaling plots": "plots",
    "confusion_png": "plots",
    "digits_pngs": "digits",
    "run_in_flow": "flows",
    "dask_task_runner": "flows",
}


def seed_torch(site_packages: Path) -> list[str]:
    """Put this environment's torch, and every distribution it requires, into another
    environment's site-packages as links to the same files; the distributions linked.

    Installing torch's wheels (torch and its CUDA libraries: 2.6 GB of wheels, several GB
    unpacked) into a new environment costs minutes; linking what is already unpacked costs
    seconds and leaves pip the same record of an installed torch (its dist-info), which it
    checks against the ddpflow wheel's range like any installed package. Hard links where
    the file system allows (a later uninstall there unlinks only the copy), else symbolic
    links to the files (pip removes a link, never its target)."""
    todo: list[tuple[str, frozenset[str]]] = [("torch", frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    linked: dict[str, importlib.metadata.Distribution] = {}
    while todo:
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: pip installs it there if torch needs it
        linked[canonicalize_name(dist.metadata["Name"])] = dist
        environments = [{"extra": extra} for extra in ("", *extras)]
        for line in dist.requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate(env) for env in environments):
                todo.append((requirement.name, frozenset(requirement.extras)))
    for dist in linked.values():
        root = Path(str(dist.locate_file("")))
        for entry in dist.files or []:
            if entry.parts[0] == "..":
                continue  # a console script in bin/: the training needs none
            source, target = root / entry, site_packages / entry
            if not source.is_file() or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                target.symlink_to(source)
    return sorted(linked)


def outside_env() -> dict[str, str]:
    """This process's environment without the project's settings and without PYTHONPATH:
    a test before may have left the checkout there, and pip, seeing the checkout's
    `ddpflow.egg-info` (the editable install's, same version as the wheel), then takes the
    wheel for installed and installs nothing."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DDPFLOW_", "MLFLOW_", "PREFECT_", "DASK_", "VIRTUAL_ENV"))
        and key != "PYTHONPATH"
    }


def in_venv(python: Path, code: str, cwd: Path, timeout_s: float) -> str:
    """Run `code` with the new environment's interpreter, outside the checkout: only what
    the wheel installed (and the folder `cwd`) can be imported."""
    env = {**outside_env(), "PYTHONPATH": str(cwd)}
    result = subprocess.run(
        [str(python), "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


@pytest.mark.timeout(1200)
def test_the_wheel_without_extras_trains_on_dask_without_prefect_or_plots(
    library_wheel: Path, tmp_path: Path
):
    """`pip install ddpflow` is the library: into a new virtual environment the wheel brings
    its own requirements only, none of Prefect, Prefect's server pins, MLflow's server,
    matplotlib or scikit-learn (the extras), and there `ddpflow.run` trains `ddpflow.fit`
    on two ranks of a LocalCluster, tracked in a sqlite:/// MLflow store. pip resolves the
    wheel's requirements for real (with constraints.txt's versions, as `make venv` and the
    image install); only torch's own files come from this environment (seed_torch)."""
    # The wheel's own requirements (those of no extra) are ranges and name no extra's package.
    wheel = zipfile.ZipFile(library_wheel)
    (metadata,) = (n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    requires = email.message_from_bytes(wheel.read(metadata)).get_all("Requires-Dist") or []
    base = [r for r in map(Requirement, requires) if "extra" not in str(r.marker or "")]
    assert {"torch", "mlflow-skinny", "distributed"} <= {canonicalize_name(r.name) for r in base}
    pinned = [str(r) for r in base if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == []
    named = {canonicalize_name(r.name) for r in base}
    assert named.isdisjoint(EXTRAS_DISTRIBUTIONS | {"fastapi"}), sorted(named)

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    try:
        assert "torch" in seed_torch(site_packages)
        # This environment's pip, installing into the new one (`--python`): no pip to
        # bootstrap there.
        pip = [sys.executable, "-m", "pip", "--python", str(python)]
        # --no-compile: the training imports a few of the installed packages' modules, not
        # each of their files (3 of the test's 44 CPU-seconds).
        constraints = str(CHECKOUT / "constraints.txt")
        install = subprocess.run(
            [*pip, "install", "-q", "--no-compile", "-c", constraints, str(library_wheel)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
            env=outside_env(),
        )
        assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-5000:]
        check = subprocess.run(
            [*pip, "check"], capture_output=True, text=True, check=False, env=outside_env()
        )
        assert check.returncode == 0, check.stdout + check.stderr

        run_folder = tmp_path / "run"
        run_folder.mkdir()
        shutil.copy2(Path(__file__).parents[1] / "helpers" / "wheel_venv_training.py", run_folder)
        found = json.loads(
            in_venv(python, "import wheel_venv_training as t; t.probe()", run_folder, 120)
        )
        assert found["importable"] == []
        assert EXTRAS_DISTRIBUTIONS.isdisjoint(found["distributions"]), found["distributions"]
        assert {"ddpflow", "torch", "mlflow-skinny", "distributed"} <= set(found["distributions"])
        # Each part that needs an extra fails at once: an ImportError naming the pip command.
        failures = found["failures"]
        assert set(failures) == set(NEEDS)
        for name, extra in NEEDS.items():
            failure = failures[name] or {}
            assert failure.get("type") == "MissingExtra", (name, failure)
            assert f"pip install 'ddpflow[{extra}]'" in failure["message"], (name, failure)

        out = in_venv(
            python,
            "import pathlib, wheel_venv_training as t; t.main(pathlib.Path.cwd())",
            run_folder,
            timeout_s=600,
        )
        result = json.loads(out.strip().splitlines()[-1])
        assert Path(result["ddpflow"]).is_relative_to(venv), "the wheel's ddpflow, not the checkout"
        losses = result["losses"]
        assert len(losses) == 3 and losses[-1] < losses[0] / 2, losses
        assert result["run_status"] == "FINISHED" and result["logged_train_loss"]
        assert result["loaded_optional"] == []
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # torch's links and the installed packages


def test_the_distributed_package_stays_small_and_its_supervisor_says_what_each_file_is():
    """ddpflow/distributed/ holds at most 10 modules (a subfolder counts as one): the watch
    over a running group lives in supervisor/, whose docstring names each of its files."""
    distributed = LIBRARY / "distributed"
    entries = [
        p for p in distributed.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    ]
    assert len(entries) <= 10, sorted(p.name for p in entries)
    supervisor = distributed / "supervisor"
    docstring = ast.get_docstring(ast.parse((supervisor / "__init__.py").read_text())) or ""
    files = sorted(p.stem for p in supervisor.glob("*.py") if p.stem != "__init__")
    unnamed = [name for name in files if f"- {name}:" not in docstring]
    assert unnamed == [], f"supervisor/__init__.py does not say what {unnamed} are"


def test_each_name_says_one_thing():
    """No two library modules called progress, and one public function called fit: the one
    users call (ddpflow.fit)."""
    progress = sorted(str(p.relative_to(CHECKOUT)) for p in LIBRARY.rglob("progress.py"))
    assert len(progress) == 1, progress
    fits = [
        str(path.relative_to(CHECKOUT))
        for path in LIBRARY.rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "fit"
    ]
    assert fits == ["ddpflow/training/fit.py"], fits
