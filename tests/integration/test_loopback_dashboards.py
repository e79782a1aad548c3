"""Clusters that ddpflow starts on this machine listen on loopback only, dashboards included."""

from __future__ import annotations

import psutil
import pytest

from ddpflow.cluster.build import build_cluster

pytestmark = pytest.mark.integration


def listening() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process and its children listen on."""
    me = psutil.Process()
    pids = {me.pid} | {child.pid for child in me.children(recursive=True)}
    return {
        (conn.laddr.ip, conn.laddr.port)
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids
    }


@pytest.mark.timeout(120)
def test_local_kind_binds_nothing_beyond_loopback() -> None:
    # Only the cluster's sockets count: a server an earlier test in this process started
    # (Prefect's embedded API, an S3 server) is not the cluster's doing.
    before = listening()
    with build_cluster("local", {"n_workers": 1}) as cluster:
        assert cluster.scheduler.http_server is not None, "the HTTP server (dashboard) runs"
        opened = listening() - before
        assert opened, "the cluster listens somewhere"
        assert {host for host, _ in opened} == {"127.0.0.1"}, sorted(opened)
