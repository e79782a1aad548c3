"""A pytest plugin for bench.suite_cost: when each test ran, on which pytest process, and
the CPU it cost.

Loaded with `-p bench.suite_timeline`; writes one line per test (process, start, end, CPU
seconds, test id; start and end are the wall clock around its setup, call and teardown) to
`$DDPFLOW_SUITE_TIMELINE/<process>.tsv`, where <process> is the xdist worker id (gw0, gw1,
...) or "main" without xdist. Without that variable it writes nothing.

A test's CPU is what the pytest process's tree spent over it: each live process's own CPU
plus that of the children it has reaped, summed over the tree, before and after. A process
that ends during the test is still counted, by whoever reaped it; what a process outside the
tree does for the test (the xdist controller's shared Prefect server, a container) is not.
A module's fixtures count for the test that first used them, their teardown for the last.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

TIMELINE_ENV = "DDPFLOW_SUITE_TIMELINE"


def tree_cpu_s() -> float:
    """CPU seconds of this process, its live descendants and the children each has reaped."""
    me = psutil.Process()
    try:
        processes = [me, *me.children(recursive=True)]
    except psutil.Error:
        processes = [me]
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended since it was listed: its parent's reaped children hold it
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = os.environ.get(TIMELINE_ENV)
    started, cpu_before = time.time(), tree_cpu_s() if folder else 0.0
    yield
    if not folder:
        return
    cpu_s = tree_cpu_s() - cpu_before
    process = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with (Path(folder) / f"{process}.tsv").open("a", encoding="utf-8") as out:
        out.write(f"{process}\t{started:.3f}\t{time.time():.3f}\t{cpu_s:.2f}\t{item.nodeid}\n")
