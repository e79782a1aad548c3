"""What the test processes' forkserver imports besides a flow's own, for their clusters' workers.

A test process runs many flows in process (run_in_process), on module clusters whose
workers all fork from that process's one forkserver, and kills and restarts workers in the
fault and outage tests. Each fresh worker imported the flows' task modules when it
unpickled its first task (0.29 CPU-seconds), and the worker that registered a model
imported what registration uses (torch.export's graph libraries, MLflow's pytorch flavour,
GitPython: 0.9 CPU-seconds) and walked every installed distribution's files once to map
packages to modules for MLflow's requirement check (0.45 CPU-seconds). Imported once in the
forkserver, a forked worker has them all. Imports only, and MLflow's map: no thread starts
and nothing is traced, so a fork is as safe as from the flows' own forkserver
(ddpflow.cluster.forkserver); a flow's command line runs one registration per forkserver,
where this would save nothing, so the product does not do it.
"""

from __future__ import annotations

import contextlib
import importlib

MODULES = (
    # The tasks the flows submit, and the flow modules their pickles name.
    "flows.charlm_pipeline",
    "flows.params",
    "tasks.charlm",
    "tasks.images",
    "tasks.inspection",
    "tasks.registration",
    "tasks.restarts",
    "tasks.tracking_report",
    # What registration imports on its first model (ddpflow.tracking.run.register_pt2_model).
    "ddpflow.workloads.charlm.evaluation",
    "ddpflow.workloads.vision.evaluation",
    "mlflow.pytorch",
    "mlflow.pyfunc",
    "networkx",
    "git",
)

for module in MODULES:
    importlib.import_module(module)

# MLflow checks a logged model's requirements against the installed packages; its first
# check maps every distribution's files to its modules and keeps the map for the process.
with contextlib.suppress(ImportError, AttributeError):  # another MLflow: it maps on use
    from mlflow.utils.requirements_utils import _init_packages_to_modules_map

    _init_packages_to_modules_map()
