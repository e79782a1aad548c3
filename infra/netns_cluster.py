"""A Dask cluster across hosts made of network namespaces, with its servers on the bridge.

Hosts: `head` runs the Dask scheduler; each worker host runs its Dask workers. The machine
itself holds the bridge address, where the Prefect server, the MLflow server and an S3
endpoint (moto) listen, as on a head node; flows run there too. Nothing listens on
127.0.0.1 for the cluster, so an address that only works on one machine fails here as it
would on a real cluster. Needs root (see infra.netns). The multi-host tests and
`python -m bench.multihost` use it.

Each host's workers run under a restart loop, as a supervisor (systemd's Restart=always, a
batch job's requeue) would run them: a Dask worker cut off from its scheduler for longer
than Dask's TCP timeout (30 s) exits, and only a supervisor brings a host that comes back
into the cluster again.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import distributed

from ddpflow.cluster.workers import WORKER_ENV
from ddpflow.distributed import cluster_workers
from infra import netns
from infra.procs import Service, spawn, stop, tcp_ok, wait_until
from infra.services import (
    BIN,
    FAKE_AWS,
    REPO,
    base_env,
    create_bucket,
    free_port,
    start_mlflow,
    start_moto,
    start_prefect_server,
)

BUCKET = "ddpflow-multihost"
SCHEDULER_PORT = 8786  # each host has its own ports: a fixed one cannot clash


@dataclass
class NetnsCluster:
    hosts: netns.Hosts
    scheduler_address: str
    prefect_url: str
    mlflow_url: str
    s3_endpoint: str
    aws: dict[str, str]  # the S3 keys and region the workers and the flow use
    workers_per_host: dict[str, int]
    workers: dict[str, Service] = field(default_factory=dict)

    def flow_env(self, artifact_root: str) -> dict[str, str]:
        """What a user sets on the machine that starts flows (the head node)."""
        return {
            **self.s3_env,
            "DDPFLOW_DASK_ADDRESS": self.scheduler_address,
            "PREFECT_API_URL": self.prefect_url,
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "DDPFLOW_ARTIFACT_ROOT": artifact_root,
        }

    @property
    def s3_env(self) -> dict[str, str]:
        return {**self.aws, "AWS_ENDPOINT_URL_S3": self.s3_endpoint}

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
        for host in self.workers_per_host:
            self.hosts.reconnect(host)
        with self.client() as client:
            client.wait_for_workers(sum(self.workers_per_host.values()), timeout=timeout_s)


def _worker_loop(multi: NetnsCluster, host: str, scratch: Path) -> list[str]:
    ip = multi.hosts.address[host]
    worker = [
        str(BIN / "dask"), "worker", multi.scheduler_address, "--nthreads", "1",
        "--nworkers", str(multi.workers_per_host[host]),
        "--host", ip, "--no-dashboard", "--dashboard-address", f"{ip}:0",
        "--local-directory", str(scratch / host),
    ]  # fmt: skip
    loop = f"while true; do {shlex.join(worker)}; sleep 1; done"
    return multi.hosts.argv(host, ["sh", "-c", loop])


@contextmanager
def netns_cluster(
    work: Path, workers_per_host: Mapping[str, int], aws: Mapping[str, str] = FAKE_AWS
) -> Iterator[NetnsCluster]:
    """Build the hosts, start the servers and the cluster; stop everything at exit.

    `workers_per_host` names the worker hosts and how many worker processes each runs.
    """
    with ExitStack() as stack:
        hosts = stack.enter_context(netns.hosts(["head", *workers_per_host]))
        bridge = hosts.bridge_address
        logs = work / "logs"
        moto = _started(stack, start_moto(free_port(bridge), logs, host=bridge))
        create_bucket(moto.url, BUCKET)
        aws_env = {**aws, "AWS_ENDPOINT_URL_S3": moto.url}
        mlflow = _started(
            stack,
            start_mlflow(
                free_port(bridge), f"sqlite:///{work / 'mlflow-server.db'}",
                f"s3://{BUCKET}/mlflow", env=aws_env, log_dir=logs, host=bridge,
            ),
        )  # fmt: skip
        prefect = _started(
            stack, start_prefect_server(free_port(bridge), work / "prefect", logs, host=bridge)
        )
        head = hosts.address["head"]
        multi = NetnsCluster(
            hosts, f"tcp://{head}:{SCHEDULER_PORT}", prefect.url, mlflow.url, moto.url,
            dict(aws), dict(workers_per_host),
        )  # fmt: skip
        # The workers hold the S3 keys (they read and write the artifact store); they get no
        # Prefect or MLflow setting: the flow hands those to what runs there.
        env = base_env({**WORKER_ENV, **aws_env, "PYTHONPATH": str(REPO)})
        scheduler_argv = [
            str(BIN / "dask"), "scheduler", "--host", head, "--port", str(SCHEDULER_PORT),
            "--no-dashboard", "--dashboard-address", f"{head}:0",
        ]  # fmt: skip
        scheduler = _started(
            stack, spawn("dask-scheduler", hosts.argv("head", scheduler_argv), env, logs)
        )
        wait_until(lambda: tcp_ok(head, SCHEDULER_PORT), 60, scheduler, "listening")
        for host in workers_per_host:
            argv = _worker_loop(multi, host, work / "dask-scratch")
            multi.workers[host] = _started(stack, spawn(f"dask-worker-{host}", argv, env, logs))
        multi.restore(timeout_s=180)
        yield multi


def _started(stack: ExitStack, service: Service) -> Service:
    stack.callback(stop, service)
    return service
