"""How `make test` splits the suite over pytest-xdist processes (tests/conftest.py).

The split is what keeps each integration module's expensive fixtures built once: a wrong
split still passes every test, only slower, so it gets a test of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import group_of

pytestmark = pytest.mark.integration

CONFTEST = Path(__file__).parents[1] / "conftest.py"
SESSION_FOLDER = Path(__file__).parents[1] / "helpers" / "session_folder.py"


def test_modules_outside_the_unit_tier_are_groups_and_unit_tests_are_not():
    assert group_of("tests/integration/test_s3.py::test_x[a::b]") == "test_s3"
    assert group_of("tests/integration/test_multihost.py::test_y") == "test_multihost"
    assert group_of("tests/integration/test_fault_tolerance.py::test_z") == "test_fault_tolerance"
    assert group_of("tests/integration/test_slurm.py::test_y") == "slurm"
    assert group_of("tests/integration/test_cluster_backends.py::T::t") == "slurm"
    assert group_of("tests/compose_stack/test_compose_stack.py::test_x") == "test_compose_stack"
    assert group_of("tests/gpu/test_nccl.py::test_x") == "test_nccl"
    assert group_of("tests/unit/test_checkpoint.py::test_x") is None


def test_each_module_and_shared_fixture_is_built_once_over_two_processes(tmp_path):
    """Six modules run on 2 processes the way `make test` runs the suite: two plain ones with
    a module-scoped fixture, two that share a session-scoped fixture of their process (the
    Slurm cluster's group), and the fault-tolerance and multi-host modules, which start first,
    on one process each, and both ask for the reference folder (session_folder). Each fixture
    and the folder are set up exactly once. (With xdist's own `loadgroup` on pytest 9.2 each
    was set up on both processes; with plain `loadscope` the two Slurm modules land on
    different processes and their cluster is built twice; without the lock both processes
    would train the reference.)"""
    integration = tmp_path / "tests" / "integration"
    integration.mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text(CONFTEST.read_text())
    helpers = tmp_path / "tests" / "helpers"  # the conftest's CHECKOUT: here, tmp_path
    helpers.mkdir()
    for name in ("__init__.py", "paths.py"):
        (helpers / name).write_text((SESSION_FOLDER.parent / name).read_text())
    log = tmp_path / "setups.log"
    log.touch()  # there before the run: what a run adds at the top fails it (tests/conftest.py)
    (integration / "conftest.py").write_text(
        SESSION_FOLDER.read_text()
        + textwrap.dedent(f"""

        import time

        def note(what):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{what}}@{{os.environ['PYTEST_XDIST_WORKER']}}\\n")

        @pytest.fixture(scope="session")
        def slurm():
            note("slurm")

        @pytest.fixture(scope="session")
        def reference(tmp_path_factory):
            def make(folder):
                note("reference")
                time.sleep(1)  # the other process asks meanwhile, and waits
                (folder / "weights").write_text("trained")

            folder = session_folder(tmp_path_factory, "reference", make)
            assert (folder / "weights").read_text() == "trained"
        """)
    )
    modules = {"test_a": "", "test_b": "", "test_fault_tolerance": "reference, "}
    modules.update({"test_multihost": "reference, ", "test_slurm": "slurm, "})
    modules["test_cluster_backends"] = "slurm, "
    for name, shared in modules.items():
        (integration / f"{name}.py").write_text(
            textwrap.dedent(f"""
            import os
            import time
            import pytest

            @pytest.fixture(scope="module")
            def built():
                with open({str(log)!r}, "a") as f:
                    f.write("{name}@" + os.environ["PYTEST_XDIST_WORKER"] + "\\n")

            def test_1({shared}built): time.sleep(0.2)
            def test_2({shared}built): time.sleep(0.2)
            """)
        )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
        + ["--dist", "loadscope", "--no-loadscope-reorder"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    setups = [line.split("@") for line in log.read_text().split()]
    assert sorted(name for name, _ in setups) == sorted([*modules, "reference", "slurm"])
    process = dict(setups)
    assert process["test_fault_tolerance"] != process["test_multihost"], "side by side"
    assert process["test_slurm"] == process["test_cluster_backends"] == process["slurm"]
