"""Fixtures for unit and integration tests alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for the module (`pytestmark = usefixtures(...)`): tiny
    tensors gain nothing from the thread pool, and on a busy machine it makes tests many
    times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


from tests.helpers.paths import CHECKOUT  # noqa: E402

# What a test run may add at the checkout's top: its tools' caches.
CACHES = {".pytest_cache", ".ruff_cache", ".import_linter_cache", "__pycache__"}
ENTRIES_AT_START = pytest.StashKey[set[str]]()
LEFT_IN_CHECKOUT = pytest.StashKey[list[str]]()


def checkout_entries() -> set[str]:
    return {path.name for path in CHECKOUT.iterdir()} - CACHES


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[ENTRIES_AT_START] = checkout_entries()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run when tests left files at the checkout's top, where a user's own runs
    live: MLflow puts a SQLite store's artifacts in ./mlruns of the working directory unless
    the experiment names a place, and .gitignore hides such a folder from `git status`. An
    xdist process leaves the check to the controller, which makes it once, after them all."""
    if hasattr(session.config, "workerinput") or ENTRIES_AT_START not in session.config.stash:
        return
    left = sorted(checkout_entries() - session.config.stash[ENTRIES_AT_START])
    if left:
        session.config.stash[LEFT_IN_CHECKOUT] = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name what the run left (the summary comes after the progress line has ended)."""
    left = terminalreporter.config.stash.get(LEFT_IN_CHECKOUT, None)
    if left:
        message = f"tests left {left} in the checkout {CHECKOUT}: write under tmp_path instead"
        terminalreporter.write_sep("=", message, red=True, bold=True)


# How `make test` spreads the suite over processes (pytest-xdist, `--dist loadscope`, with the
# scheduler below). Each integration module runs whole on one process, so its module-scoped
# fixtures (a cluster, a trained project, a server) are built once; so does each module of
# the other tiers outside tests/unit (the compose stack, GPU). Modules sharing a
# session-scoped fixture that lives in its process share a group, so that fixture is built
# once too: the Slurm cluster. (The uninterrupted reference run that the fault-tolerance,
# multi-host and graceful-leave modules compare with is a folder any process reads, made
# once under a file lock: tests/helpers/session_folder.py; so those modules, about 20
# minutes together, run side by side.) Unit tests have no group: any process takes them
# one by one.
#
# Why a scheduler and not `xdist_group` marks: pytest-xdist 3.8 puts a mark's group into the
# test id by assigning `item._nodeid`, which pytest 9.2 no longer reads (the id lives in
# `item._id`), so with `--dist loadgroup` every test was its own unit and each module's
# fixtures were built once on each process. tests/integration/test_xdist_groups.py checks the split.
SHARED_GROUPS = {
    "test_slurm": "slurm",
    "test_cluster_backends": "slurm",
    # The session's local stack (integration conftest's local_stack), started once for them.
    "test_deployments": "stack",
    "test_stack": "stack",
    "test_stack_uis": "stack",
}
# Longest groups first (seconds measured in a full run on 2 cores): a process that picks a
# 15-minute group last would leave the other idle for its whole length. The compose stack
# (2-5 minutes) is not among them and runs last, as in every passing run: in both runs with
# it first, its ten containers ran beside the fault and launcher tests and a LocalCluster
# there lost a nanny (ddpflow/cluster/kept_nannies.py; load is the likely link, not proven).
HEAVY_FIRST = [
    "test_fault_tolerance",  # ~460-590 s; it and multi-host start together, one computes
    "test_multihost",  # ~450-490 s; the shared reference while the other waits for it
    # ~500 s: the stack's start (90-130 s), deployments, its checks, a training, 4 browser pages
    "stack",
    "test_outages",  # ~270 s, two minutes of it waiting out the outages (little CPU)
    "test_sweep_flow",
    "test_train_charlm_flow",
    "test_images_flow",
    "test_tracking_outage",  # ~290 s, two minutes of it an outage (little CPU): never at the tail
    "slurm",
    "test_external_cluster",
    "test_bad_inputs_cli",
    "test_s3",
    "test_retrain_flow",
    "test_secrets",
    "test_inspection",
    "test_graceful_leave",
    "test_house_layout",  # ~150 s: builds the wheel, trains in a venv of its own
    "test_promotion_limit",  # ~110 s, most of it a frozen holder's lease running out
]


def group_of(nodeid: str) -> str | None:
    """The group a test id belongs to: its module's (or shared) group, or None for a unit
    test, which any process may take alone. Every tier but the unit one builds module-scoped
    fixtures worth sharing, and the compose stack's two tests must not run apart: two
    processes each bringing up the same compose project at once race to create its network
    (Docker made two of the same name) and its containers."""
    path = PurePosixPath(nodeid.split("::", 1)[0])
    if path.parent.name == "unit":
        return None
    return SHARED_GROUPS.get(path.stem, path.stem)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the heaviest groups first; the order within a group is kept, but for the test
    that stops the shared local stack, which goes last."""

    def rank(item: pytest.Item) -> tuple[int, bool]:
        group = group_of(item.nodeid)
        heavy = HEAVY_FIRST.index(group) if group in HEAVY_FIRST else len(HEAVY_FIRST)
        return heavy, item.get_closest_marker("stops_local_stack") is not None

    items.sort(key=rank)  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadscope` with a group (see `group_of`) as the unit of work."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or nodeid

    return GroupScheduling(config, log)


# One Prefect API server for a whole xdist run, started by the controller and handed to each
# test process (`shared_prefect_server` in tests/integration/conftest.py adopts it): an idle
# server costs about 1.5 CPU-seconds a minute (Prefect's background worker polls its queue
# every 0.1 s), so one per test process cost two more such servers for the whole run, plus
# their starts. On where the project's pytest settings turn it on (pyproject.toml); a run
# without xdist, or of unit tests alone, starts none here. The helpers are imported where
# they are used: test_xdist_groups.py runs this file in a project that has none of them.
SHARED_SERVER = pytest.StashKey[Any]()
UNIT_TESTS = CHECKOUT / "tests" / "unit"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "shared_prefect_server",
        "xdist's controller starts one Prefect API server for every test process",
        type="bool",
        default=False,
    )


def _runs_integration_tests(config: pytest.Config) -> bool:
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    return not paths or any(not path.is_relative_to(UNIT_TESTS) for path in paths)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, for each test process it starts: the shared server's URL and
    folder (started at the first process, without waiting for it to answer: its socket is
    bound, and the test processes wait for it when a test first needs it)."""
    config = node.config
    if SHARED_SERVER not in config.stash:
        config.stash[SHARED_SERVER] = None
        if config.getini("shared_prefect_server") and _runs_integration_tests(config):
            from tests.helpers.prefect_harness import start_prefect_server
            from tests.helpers.projects import migrated_prefect_db

            server = start_prefect_server(migrated_prefect_db(), die_with_this_process=True)
            config.stash[SHARED_SERVER] = server
    server = config.stash[SHARED_SERVER]
    if server is not None:
        from tests.helpers.prefect_harness import SHARED_PREFECT_API

        node.workerinput[SHARED_PREFECT_API] = {"url": server.url, "home": str(server.home)}


def pytest_unconfigure(config: pytest.Config) -> None:
    server = config.stash.get(SHARED_SERVER, None)
    if server is not None:
        from tests.helpers.prefect_harness import stop_prefect_server

        stop_prefect_server(server)
