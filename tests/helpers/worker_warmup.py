"""What the test processes' forkserver imports besides a flow's own, for their clusters' workers.

A test process runs many flows in process (run_in_process), on module clusters whose
workers all fork from that process's one forkserver, and kills and restarts workers in the
fault and outage tests. Each fresh worker imported the library modules the tasks and ranks
use when it unpickled its first task (0.23 CPU-seconds), and the worker that registered a
model imported what registration uses (torch.export's graph libraries, MLflow's pyfunc and
registry store, GitPython) and walked every installed distribution's files once to map
packages to modules for MLflow's requirement check (0.45 CPU-seconds). Imported once in the
forkserver, a forked worker has them all. A flow's command line registers one model per
forkserver, where this would save nothing, so the product does not do it.

Only library modules: not `flows` or `tasks`, whose `from prefect import task` runs
Prefect's logging setup (prefect.main) with the settings of the process it runs in, which a
worker must take from its nanny (ddpflow.integrations.prefect.flow_workers); and MLflow's
pytorch flavour through ddpflow's import of it, which leaves the root logger as it was
(ddpflow.tracking.mlflow_pytorch). Nothing here starts a thread or traces a model.
"""

from __future__ import annotations

import contextlib
import importlib

MODULES = (
    # What the tasks and the ranks import from the library.
    "ddpflow.api",
    "ddpflow.workloads.charlm.training",
    "ddpflow.workloads.charlm.evaluation",
    "ddpflow.workloads.charlm.shard_format",
    "ddpflow.workloads.sweep",
    "ddpflow.tracking.inspection",
    "ddpflow.workloads.vision.evaluation",
    # What registration imports on its first model (ddpflow.tracking.run.register_pt2_model).
    "ddpflow.workloads.registration",
    "ddpflow.tracking.mlflow_pytorch",
    "mlflow.pyfunc",
    "mlflow.store.model_registry.sqlalchemy_store",
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
