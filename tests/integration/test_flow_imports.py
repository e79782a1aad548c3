"""The flow process starts without torch: importing torch costs seconds before each run's
first step (1.7 s on a quiet 2-core machine, 8 s under load), and only the ranks and the
evaluation tasks need it. Modules the flows import keep torch inside the functions that
run on the workers, or leave it to a sibling module (a job's torch-free dataclass)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import flows
from ddpflow.workloads.vision.image_folder import IMG_EXTENSIONS
from tests.integration.conftest import REPO

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
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
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
