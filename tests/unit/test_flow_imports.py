"""The flow process starts without torch: importing torch costs seconds before each run's
first step (1.7 s on a quiet 2-core machine, 8 s under load), and only the ranks and the
evaluation tasks need it. Modules the flows import keep torch inside the functions that
run on the workers, or leave it to a sibling module (a job's torch-free dataclass)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import ddpflow_flows
from ddpflow.vision.image_folder import IMG_EXTENSIONS
from tests.integration.conftest import REPO

HEAVY = ("torch", "torchvision", "mlflow.pytorch")


def test_every_flow_module_imports_without_torch():
    flows = [f"ddpflow_flows.{m.name}" for m in pkgutil.iter_modules(ddpflow_flows.__path__)]
    assert "ddpflow_flows.train_charlm" in flows and "ddpflow_flows.train_images" in flows
    script = (
        "import importlib, sys\n"
        f"for name in {flows!r}:\n"
        "    importlib.import_module(name)\n"
        "import ddpflow, ddpflow.api, ddpflow_tasks.ddp\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", (
        f"importing the flows loaded {done.stdout.strip()}: import it inside the function "
        "that runs on a worker (python -X importtime shows the chain)"
    )


def test_the_image_extensions_are_torchvisions():
    """Written out so that listing an image folder needs no torch; they must not drift."""
    from torchvision.datasets.folder import IMG_EXTENSIONS as TORCHVISION_EXTENSIONS

    assert IMG_EXTENSIONS == TORCHVISION_EXTENSIONS
