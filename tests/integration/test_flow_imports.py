"""The flow process starts without torch: importing torch costs seconds before each run's
first step (1.7 s on a quiet 2-core machine, 8 s under load), and only the ranks and the
evaluation tasks need it. Modules the flows import keep torch inside the functions that
run on the workers, or leave it to a sibling module (a job's torch-free dataclass)."""

from __future__ import annotations

import pickle
import pkgutil
import subprocess
import sys

import pytest

import flows
from ddpflow.workloads.charlm.report import EvalResult
from ddpflow.workloads.vision.image_folder import IMG_EXTENSIONS
from ddpflow.workloads.vision.reports import ImageEvalResult
from tests.helpers.paths import CHECKOUT

pytestmark = pytest.mark.integration

HEAVY = ("torch", "torchvision", "mlflow.pytorch")


def test_every_flow_module_imports_without_torch_and_starts_nothing():
    modules = [f"flows.{m.name}" for m in pkgutil.iter_modules(flows.__path__)]
    assert "flows.train_charlm" in modules and "flows.train_images" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "import ddpflow, ddpflow.api, ddpflow.integrations.prefect.run_in_flow\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "import psutil\n"
        "print(len(psutil.Process().children(recursive=True)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=CHECKOUT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    heavy, children = done.stdout.split("\n")[:2]
    assert heavy == "[]", (
        f"importing the flows loaded {heavy}: import it inside the function "
        "that runs on a worker (python -X importtime shows the chain)"
    )
    # Servers and clusters start in a flow's __main__ guard
    # (ddpflow/integrations/prefect/early_api.py), never on import.
    assert children == "0", f"importing the flows started {children} processes"


def test_the_image_extensions_are_torchvisions():
    """Written out so that listing an image folder needs no torch; they must not drift."""
    from torchvision.datasets.folder import IMG_EXTENSIONS as TORCHVISION_EXTENSIONS

    assert IMG_EXTENSIONS == TORCHVISION_EXTENSIONS


def test_the_evaluation_results_the_flow_receives_unpickle_without_torch():
    """The evaluation tasks run on workers and return their result to the flow process, which
    unpickles it: the result's module is imported there, so it must not import torch (it did
    until 2026-11-29: 2 CPU-s at the end of every run, in a process that trains nothing)."""
    results = [
        EvalResult(1.5, ["Rex"], 1.0, "file:///tmp/c.pt", 3),
        ImageEvalResult(0.5, 0.75, 4, ["a", "b"], [[1, 1], [0, 2]], "file:///tmp/c.pt", 2),
    ]
    script = (
        "import pickle, sys\n"
        "import flows.train_charlm, flows.train_images\n"
        "results = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
        "print([type(r).__name__ for r in results], results[1].per_class['b']['accuracy'])\n"
        f"print(sorted(m for m in {(*HEAVY, 'matplotlib')!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, pickle.dumps(results).hex()],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    received, heavy = done.stdout.split("\n")[:2]
    assert received == "['EvalResult', 'ImageEvalResult'] 1.0"
    assert heavy == "[]", f"unpickling the evaluation results loaded {heavy}"
