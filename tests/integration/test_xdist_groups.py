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


def test_modules_outside_the_unit_tier_are_groups_and_unit_tests_are_not():
    assert group_of("tests/integration/test_s3.py::test_x[a::b]") == "test_s3"
    assert group_of("tests/integration/test_multihost.py::test_y") == "charlm-reference"
    assert group_of("tests/integration/test_fault_tolerance.py::test_z") == "charlm-reference"
    assert group_of("tests/integration/test_cluster_backends.py::T::t") == "slurm"
    assert group_of("tests/compose_stack/test_compose_stack.py::test_x") == "test_compose_stack"
    assert group_of("tests/gpu/test_nccl.py::test_x") == "test_nccl"
    assert group_of("tests/unit/test_checkpoint.py::test_x") is None


def test_each_module_and_shared_fixture_is_built_once_over_two_processes(tmp_path):
    """Four modules run on 2 processes the way `make test` runs the suite: two plain ones
    with a module-scoped fixture, and the two that share the session-scoped reference run.
    Each fixture is set up exactly once. (With xdist's own `loadgroup` on pytest 9.2 each
    was set up on both processes; with plain `loadscope` the two sharing modules land on
    different processes and the shared one is built twice.)"""
    integration = tmp_path / "tests" / "integration"
    integration.mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text(CONFTEST.read_text())
    log = tmp_path / "setups.log"
    (integration / "conftest.py").write_text(
        textwrap.dedent(f"""
        import pytest

        @pytest.fixture(scope="session")
        def reference():
            with open({str(log)!r}, "a") as f:
                f.write("reference\\n")
        """)
    )
    modules = {"test_a": "", "test_b": "", "test_fault_tolerance": "reference, "}
    modules["test_multihost"] = "reference, "
    for name, shared in modules.items():
        (integration / f"{name}.py").write_text(
            textwrap.dedent(f"""
            import time
            import pytest

            @pytest.fixture(scope="module")
            def built():
                with open({str(log)!r}, "a") as f:
                    f.write("{name}\\n")

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
    assert sorted(log.read_text().split()) == sorted([*modules, "reference"])
