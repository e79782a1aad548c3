"""What ddpflow logs inside the worker processes of a test's Dask cluster, kept there for the
test to read back.

A worker's log lines go to its stderr, which the test cannot read reliably: a LocalCluster's
workers fork from a server that keeps the stderr it had when it started (the pytest process's
capture of an earlier test, say), and nothing sends them to Prefect. So each worker keeps the
records of a logger (and its children) in a list on that logger, through a handler of the
test's own, added before the flow starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import distributed

from ddpflow.cluster.build import local_cluster


@contextmanager
def cluster_keeping_logs(
    env: Mapping[str, str], logger_name: str = "ddpflow"
) -> Iterator[distributed.Client]:
    """A 2-worker LocalCluster of the test's own, whose worker processes run with `env` and
    keep what `logger_name` logs from before any flow starts (worker_log reads it); yields a
    client of it."""
    with (
        local_cluster(2, env=env, tls=False) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        keep_worker_logs(client, logger_name)
        yield client


def keep_worker_logs(client: distributed.Client, logger_name: str = "ddpflow") -> None:
    """From now on, each of the client's workers keeps what `logger_name` logs."""

    def keep() -> None:
        # Runs in each worker process (shipped by value): the list hangs on the logger.
        import logging

        logger = logging.getLogger(logger_name)
        kept: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: kept.append(f"{record.name}: {record.getMessage()}")
        logger.ddpflow_test_kept = kept
        logger.addHandler(handler)

    client.run(keep)


def worker_log(client: distributed.Client, logger_name: str = "ddpflow") -> str:
    """Every line `logger_name` logged in the client's workers since keep_worker_logs (a
    worker started later, a replacement, has none)."""

    def kept() -> list[str]:
        import logging

        return list(getattr(logging.getLogger(logger_name), "ddpflow_test_kept", []))

    return "\n".join(line for lines in client.run(kept).values() for line in lines)
