"""A pytest plugin for bench.suite_cost: when each test ran, and on which pytest process.

Loaded with `-p bench.suite_timeline`; writes one line per test (process, start, end, test id;
start and end are the wall clock around its setup, call and teardown) to
`$DDPFLOW_SUITE_TIMELINE/<process>.tsv`, where <process> is the xdist worker id (gw0, gw1,
...) or "main" without xdist. Without that variable it writes nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TIMELINE_ENV = "DDPFLOW_SUITE_TIMELINE"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    started = time.time()
    yield
    folder = os.environ.get(TIMELINE_ENV)
    if not folder:
        return
    process = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with (Path(folder) / f"{process}.tsv").open("a", encoding="utf-8") as out:
        out.write(f"{process}\t{started:.3f}\t{time.time():.3f}\t{item.nodeid}\n")
