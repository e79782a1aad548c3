"""The multi-host tests' cluster: three hosts made of network namespaces
(infra.netns_cluster).

`head` runs the Dask scheduler, `a` and `b` one Dask worker each under a restart loop; the
Prefect server, the MLflow server and moto listen on the bridge address (moto, not the
SeaweedFS of the other S3 tests: infra/seaweedfs/server.py binds 127.0.0.1 only). The S3
keys are the tests' distinctive ones, so a leak would be found.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from infra.netns_cluster import BUCKET, NetnsCluster, netns_cluster
from tests.helpers.s3_servers import ACCESS_KEY, SECRET_KEY

__all__ = ["BUCKET", "MultiHost", "loopback_forwarder", "multihost_cluster"]

MultiHost = NetnsCluster
WORKERS_PER_HOST = {"a": 1, "b": 1}
TEST_AWS = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def multihost_cluster(work: Path) -> Iterator[MultiHost]:
    with netns_cluster(work, WORKERS_PER_HOST, TEST_AWS) as cluster:
        yield cluster


@contextmanager
def loopback_forwarder(target_url: str) -> Iterator[str]:
    """`target_url`'s server, also reachable at a 127.0.0.1 URL, but only from this host:
    what a user gets who points a setting at `http://127.0.0.1:PORT` on the head node."""
    target = urlsplit(target_url)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    stopped = threading.Event()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while not stopped.is_set():
            try:
                inbound, _ = listener.accept()
            except TimeoutError:
                continue
            outbound = socket.create_connection((target.hostname, target.port), timeout=10)
            for src, dst in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}{target.path}"
    finally:
        stopped.set()
        thread.join(5)
        listener.close()
