"""A Dask cluster across hosts made of network namespaces, with its servers on the bridge.

Hosts: `head` runs the Dask scheduler, `a` and `b` one Dask worker each. The machine itself
holds the bridge address, where the Prefect server, the MLflow server and the S3 endpoint
(moto) listen, as on a head node; the flows run there too. Nothing listens on 127.0.0.1 for
the cluster, so an address that only works on one machine fails here as on a real cluster.

Each worker runs under a restart loop, as a supervisor (systemd's Restart=always, a batch
job's requeue) would run it: a Dask worker cut off from its scheduler for longer than
Dask's TCP timeout (30 s) exits, and only a supervisor brings a host that comes back into
the cluster again.
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import distributed

from ddpflow.cluster import WORKER_ENV
from ddpflow.distributed import RankContext, cluster_workers
from infra import netns
from infra.procs import Service, spawn, stop, tcp_ok, wait_until
from infra.services import (
    BIN,
    base_env,
    create_bucket,
    free_port,
    start_mlflow,
    start_moto,
    start_prefect_server,
)
from tests.integration.conftest import REPO
from tests.integration.s3_servers import s3_env

BUCKET = "ddpflow-multihost"
SCHEDULER_PORT = 8786  # each host has its own ports: a fixed one cannot clash
WORKER_HOSTS = ("a", "b")


@dataclass
class MultiHost:
    hosts: netns.Hosts
    scheduler_address: str
    prefect_url: str
    mlflow_url: str
    s3_endpoint: str
    workers: dict[str, Service]

    def flow_env(self, artifact_root: str) -> dict[str, str]:
        """What a user sets on the machine that starts flows (the head node)."""
        return {
            **s3_env(self.s3_endpoint),
            "DDPFLOW_DASK_ADDRESS": self.scheduler_address,
            "PREFECT_API_URL": self.prefect_url,
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "DDPFLOW_ARTIFACT_ROOT": artifact_root,
        }

    @contextmanager
    def client(self) -> Iterator[distributed.Client]:
        with distributed.Client(self.scheduler_address, timeout=30) as client:
            yield client

    def worker_on(self, client: distributed.Client, host: str) -> str:
        prefix = f"tcp://{self.hosts.address[host]}:"
        (address,) = [w for w in cluster_workers(client) if w.startswith(prefix)]
        return address

    def restore(self, timeout_s: float = 120) -> None:
        """Every host on the network and its worker registered: the state each test expects."""
        for host in WORKER_HOSTS:
            self.hosts.reconnect(host)
        with self.client() as client:
            client.wait_for_workers(len(WORKER_HOSTS), timeout=timeout_s)


def _worker_loop(multi: MultiHost, host: str, scratch: Path) -> list[str]:
    ip = multi.hosts.address[host]
    worker = [
        str(BIN / "dask"), "worker", multi.scheduler_address, "--nthreads", "1",
        "--host", ip, "--no-dashboard", "--dashboard-address", f"{ip}:0",
        "--local-directory", str(scratch / host),
    ]  # fmt: skip
    loop = f"while true; do {shlex.join(worker)}; sleep 1; done"
    return multi.hosts.argv(host, ["sh", "-c", loop])


@contextmanager
def multihost_cluster(work: Path) -> Iterator[MultiHost]:
    """Build the hosts, start the servers and the cluster; stop everything at exit."""
    with ExitStack() as stack:
        hosts = stack.enter_context(netns.hosts(["head", *WORKER_HOSTS]))
        bridge = hosts.bridge_address
        logs = work / "logs"
        moto = _started(stack, start_moto(free_port(bridge), logs, host=bridge))
        create_bucket(moto.url, BUCKET)
        mlflow = _started(
            stack,
            start_mlflow(
                free_port(bridge), f"sqlite:///{work / 'mlflow-server.db'}",
                f"s3://{BUCKET}/mlflow", env=s3_env(moto.url), log_dir=logs, host=bridge,
            ),
        )  # fmt: skip
        prefect = _started(
            stack, start_prefect_server(free_port(bridge), work / "prefect", logs, host=bridge)
        )
        head = hosts.address["head"]
        multi = MultiHost(
            hosts, f"tcp://{head}:{SCHEDULER_PORT}", prefect.url, mlflow.url, moto.url, {}
        )
        # The workers hold the S3 keys (they read and write the artifact store); they get no
        # Prefect or MLflow setting: the flow hands those to what runs there.
        env = base_env({**WORKER_ENV, **s3_env(moto.url), "PYTHONPATH": str(REPO)})
        scheduler_argv = [
            str(BIN / "dask"), "scheduler", "--host", head, "--port", str(SCHEDULER_PORT),
            "--no-dashboard", "--dashboard-address", f"{head}:0",
        ]  # fmt: skip
        scheduler = _started(
            stack, spawn("dask-scheduler", hosts.argv("head", scheduler_argv), env, logs)
        )
        wait_until(lambda: tcp_ok(head, SCHEDULER_PORT), 60, scheduler, "listening")
        for host in WORKER_HOSTS:
            argv = _worker_loop(multi, host, work / "dask-scratch")
            multi.workers[host] = _started(stack, spawn(f"dask-worker-{host}", argv, env, logs))
        multi.restore(timeout_s=180)
        yield multi


def _started(stack: ExitStack, service: Service) -> Service:
    stack.callback(stop, service)
    return service


def wait_for(check, timeout_s: float, what: str, poll_s: float = 0.2) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g}s"
        time.sleep(poll_s)


def stuck_once(ctx: RankContext, marker_dir: str) -> float:
    """First attempt: rank 0 fails at once, rank 1 is stuck and keeps its worker's thread.

    It lives here, not in the test module, so the workers can import it by name."""
    marker = Path(marker_dir) / f"rank{ctx.rank}"
    if not marker.exists():
        marker.write_text(str(time.time()))
        if ctx.rank == 0:
            raise RuntimeError("rank 0 fails on purpose")
        time.sleep(120)
    return time.time()


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


def advertise_loopback_once() -> None:
    """Run on the workers (fault injection): the next rank on each binds gloo to 127.0.0.1,
    as stock gloo does where /etc/hosts maps the host name to loopback, so the rendezvous
    across hosts fails as it did before ranks bound their worker's address."""
    from ddpflow.distributed import context

    original = context.bound_gloo_options

    def loopback(host: str, timeout):  # noqa: ANN001, ANN202
        context.bound_gloo_options = original
        return original("127.0.0.1", timeout)

    context.bound_gloo_options = loopback


def started_at(ctx: RankContext) -> float:
    return time.time()
