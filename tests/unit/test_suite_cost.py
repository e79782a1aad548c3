"""bench.suite_cost's bookkeeping: which kind a process is, and the modules each pytest process
ran, in order."""

from __future__ import annotations

import re
import shlex

import pytest

from bench.suite_cost import REPO, kind_of, make_test_args, module_spans, read_timeline

FORKSERVER = (
    "/x/.venv/bin/python -B -c from multiprocessing.forkserver import main; main(29, 32, "
    "['distributed', 'numpy', 'torch', 'mlflow'], **{})"
)


@pytest.mark.parametrize(
    ("command", "parent", "kind"),
    [
        (FORKSERVER, "/x/.venv/bin/python -m flows.train_charlm", "forkserver"),
        (FORKSERVER, FORKSERVER, "Dask workers (forked)"),
        (
            "/x/python -m uvicorn --factory prefect.server.api.server:create_app",
            "",
            "Prefect server",
        ),
        ("/x/python /x/bin/prefect server start --port 4200", "", "Prefect server"),
        ("/x/python -m prefect deployment run a/b", "", "Prefect command line"),
        ("/x/python -m flows.train_charlm --epochs 1", "", "python -m flows/examples"),
        ("/x/python -u -c import sys;exec(eval(sys.stdin.readline()))", "", "pytest processes"),
        (
            "/x/python /x/bin/dask worker tcp://h:1 --nworkers 2",
            "",
            "dask scheduler/worker command",
        ),
        ("/x/python /x/bin/mlflow server --host 127.0.0.1", "", "MLflow server"),
        ("/x/python -m infra.s3_endpoint -H 127.0.0.1", "", "S3 endpoint (moto)"),
        ("dockerd --iptables=false", "", "Docker engine"),
        ("/opt/python/bin/python3 /opt/python/bin/pip install torch", "", "pip (image build)"),
        ("/x/python -c print(1)", "", "other Python"),
        ("", "", "kernel threads, exited"),
    ],
)
def test_a_process_is_told_by_its_command_line_and_a_worker_by_its_parent(command, parent, kind):
    assert kind_of(command, parent) == kind


def test_modules_are_spans_per_process_in_start_order_and_the_unit_tier_is_one():
    lines = [
        "gw0\t100.0\t130.0\t7.50\ttests/integration/test_b.py::test_1\n",
        "gw0\t10.0\t40.0\t20.25\ttests/integration/test_a.py::test_1\n",
        "gw0\t40.0\t90.0\t1.50\ttests/integration/test_a.py::test_2[x::y]\n",
        "gw1\t12.0\t13.0\t0.50\ttests/unit/test_u.py::test_1\n",
        "gw1\t20.0\t22.0\t0.25\ttests/unit/test_v.py::test_1\n",
    ]
    tests = read_timeline(lines)
    assert tests[2].nodeid == "tests/integration/test_a.py::test_2[x::y]"
    spans = [
        (s.process, s.module, s.start, s.end, s.summed_s, s.tests, s.cpu_s)
        for s in module_spans(tests)
    ]
    assert spans == [
        ("gw0", "tests/integration/test_a.py", 10.0, 90.0, 80.0, 2, 21.75),
        ("gw0", "tests/integration/test_b.py", 100.0, 130.0, 30.0, 1, 7.5),
        ("gw1", "tests/unit", 12.0, 22.0, 3.0, 2, 0.75),
    ]


def test_the_suite_runs_with_the_pytest_arguments_of_make_test(monkeypatch):
    """bench.suite_cost keeps its own copy of `make test`'s pytest arguments: a change to the
    Makefile's recipe must show here, or the bench would measure another suite."""
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    processes = re.search(r"^TEST_PROCS \?= (\S+)$", makefile, re.MULTILINE).group(1)
    recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", makefile, re.MULTILINE).group(1)
    (pytest_line,) = [line for line in recipe.splitlines() if " -m pytest " in line]
    made = shlex.split(pytest_line.replace("$(TEST_PROCS)", processes))
    monkeypatch.delenv("TEST_PROCS", raising=False)
    ours = make_test_args()
    starts = [i for i in range(len(made)) if made[i : i + len(ours)] == ours]
    assert starts, f"make test runs {made}, bench.suite_cost {ours}"
