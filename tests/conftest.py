"""Fixtures for unit and integration tests alike."""

from __future__ import annotations

from collections.abc import Iterator

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


# How `make test` spreads the suite over processes (pytest-xdist, `--dist loadgroup`).
# Each integration module runs whole on one process, so its module-scoped fixtures (a
# cluster, a trained project, a server) are built once. Modules sharing a session-scoped
# fixture share a group, so that fixture is built once too: the uninterrupted reference run
# (fault tolerance, multi-host) and the Slurm cluster. Unit tests have no group: any process
# takes them one by one.
SHARED_GROUPS = {
    "test_fault_tolerance": "charlm-reference",
    "test_multihost": "charlm-reference",
    "test_slurm": "slurm",
    "test_cluster_backends": "slurm",
}
# Longest groups first (seconds measured in a full run on 2 cores): a process that picks a
# 15-minute group last would leave the other idle for its whole length.
HEAVY_FIRST = [
    "charlm-reference",  # ~1000 s
    "test_deployments",  # ~400 s
    "test_sweep_flow",
    "test_train_charlm_flow",
    "test_images_flow",
    "slurm",
    "test_external_cluster",
    "test_bad_inputs_cli",
    "test_s3",
    "test_retrain_flow",
    "test_secrets",
    "test_inspection",
]


def _group(item: pytest.Item) -> str | None:
    if item.path.parent.name != "integration":
        return None
    return SHARED_GROUPS.get(item.path.stem, item.path.stem)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each integration test with its group (before xdist reads the marks) and put
    the heaviest groups first; the order within a group is kept."""
    groups = {item.nodeid: _group(item) for item in items}
    for item in items:
        if groups[item.nodeid] is not None:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))

    def rank(item: pytest.Item) -> int:
        group = groups[item.nodeid]
        return HEAVY_FIRST.index(group) if group in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)  # stable
