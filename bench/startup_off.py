"""`python -m flows.train_charlm` with one start-up piece switched off, for bench.startup_pieces.

    python -m bench.startup_off PIECE [the flow's arguments]

PIECE is `none` (everything as shipped) or one of PIECES. The switch is made in this process
before the flow module runs (as `__main__`, with runpy, as `python -m` runs it), so no
option of the flow's own is needed. Standard library only until then, and nothing imported
here that the flow's command line would not import before its own start-up code.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

FLOW_MODULE = "flows.train_charlm"
NO_FILE = "/nonexistent/ddpflow-startup-off.db"  # a template that is not there: none is copied


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` right after module `name` has run, before anyone imports from it."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_then(module: ModuleType) -> None:
            run(module)
            self.then(module)

        spec.loader.exec_module = run_then  # type: ignore[method-assign]
        return spec


def _no_early_api() -> None:
    """No server started before the imports: Prefect starts its own temporary one when the
    flow is called. The database is still copied from the template (the same `seed()` a
    user's flow is told to call), which is a piece of its own. The early cluster needs the
    embedded API's URL, so it does not start either."""
    from ddpflow.integrations.prefect import early_api

    def seed_only(*args: object, **kwargs: object) -> None:
        from ddpflow.integrations.prefect.db_template import seed

        seed()

    early_api.start_services = seed_only


def _no_early_cluster() -> None:
    """The task runner builds the flow's LocalCluster when the flow asks for it."""
    from ddpflow.integrations.prefect import early_cluster

    early_cluster.start_early = lambda api_url: None


def _no_forkserver() -> None:
    """Dask's own way to start a nanny's worker (spawn: a fresh interpreter per worker)."""

    def off(module: ModuleType) -> None:
        module.fork_workers_from_a_preloaded_server = lambda: None  # type: ignore[attr-defined]

    # After its import, not now: it imports Dask, which the flow loads later.
    sys.meta_path.insert(0, _AfterImport("ddpflow.cluster.forkserver", off))


def _no_template(variable: str) -> Callable[[], None]:
    """The template `variable` names is not there: the product migrates a new database."""
    return lambda: os.environ.__setitem__(variable, NO_FILE)


PIECES: dict[str, Callable[[], None]] = {
    "early_api": _no_early_api,
    "early_cluster": _no_early_cluster,
    "prefect_db_template": _no_template("DDPFLOW_PREFECT_DB_TEMPLATE"),
    "mlflow_store_template": _no_template("DDPFLOW_MLFLOW_DB_TEMPLATE"),
    "forkserver": _no_forkserver,
}


def main() -> None:
    piece = sys.argv.pop(1)
    if piece != "none":
        PIECES[piece]()
    runpy.run_module(FLOW_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
