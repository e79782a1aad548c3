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
into the cluster again. `add_host` brings up one more worker host while the cluster runs (a
node that joins mid-training) and `remove_host` takes it away again.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import distributed

from ddpflow.cluster.workers import WORKER_CLI_ARGS, WORKER_ENV
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
    worker_env: dict[str, str] = field(default_factory=dict, repr=False)  # what workers get
    work: Path = Path()  # the logs and the Dask scratch folders are under it

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

    def start_workers(self, host: str) -> None:
        """Start host's workers under their restart loop (stopped at the cluster's exit)."""
        argv = _worker_loop(self, host, self.work / "dask-scratch")
        name = f"dask-worker-{host}"
        self.workers[host] = spawn(name, argv, self.worker_env, self.work / "logs")

    def add_host(self, name: str, workers: int = 1, timeout_s: float = 120) -> str:
        """One more worker host on the bridge, its workers started and registered with the
        scheduler (a node that joins a running cluster); its address. `restore` counts it
        until `remove_host` takes it away; the cluster's exit removes it with the others."""
        hosts = self.hosts
        tag = hosts.bridge.removeprefix("ddpf")
        octet = hosts.bridge_address.split(".")[1]
        index = max(int(a.rsplit(".", 1)[1]) for a in hosts.address.values()) - 1  # the next
        address = f"10.{octet}.0.{index + 2}"
        netns.add_host(hosts, name, f"ddpf{tag}-{name}", address, tag, index)
        self.workers_per_host[name] = workers
        self.start_workers(name)
        prefix = f"tcp://{address}:"
        with self.client() as client:
            wait_until(
                lambda: sum(w.startswith(prefix) for w in cluster_workers(client)) == workers,
                timeout_s, self.workers[name], f"{workers} worker(s) of {name} registered",
            )  # fmt: skip
        return address

    def remove_host(self, name: str, timeout_s: float = 60) -> None:
        """Stop a host's workers, wait until the scheduler has forgotten them, and take its
        namespace (and so its link) away: the cluster is as it was before `add_host`."""
        prefix = f"tcp://{self.hosts.address[name]}:"
        service = self.workers.pop(name, None)
        if service is not None:
            stop(service)  # SIGTERM: each worker closes and unregisters
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while any(w.startswith(prefix) for w in cluster_workers(client)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the scheduler still lists a worker of {name}")
                time.sleep(0.2)
        for pid in self.hosts.pids(name):  # nothing outlives its host
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        namespace = self.hosts.namespace.pop(name)
        subprocess.run([netns.IP, "netns", "del", namespace], check=True, timeout=10)
        del self.hosts.address[name], self.workers_per_host[name]

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
        "--local-directory", str(scratch / host), *WORKER_CLI_ARGS,
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
        # The workers hold the S3 keys (they read and write the artifact store); they get no
        # Prefect or MLflow setting: the flow hands those to what runs there.
        env = base_env({**WORKER_ENV, **aws_env, "PYTHONPATH": str(REPO)})
        multi = NetnsCluster(
            hosts, f"tcp://{head}:{SCHEDULER_PORT}", prefect.url, mlflow.url, moto.url,
            dict(aws), dict(workers_per_host), worker_env=env, work=work,
        )  # fmt: skip
        scheduler_argv = [
            str(BIN / "dask"), "scheduler", "--host", head, "--port", str(SCHEDULER_PORT),
            "--no-dashboard", "--dashboard-address", f"{head}:0",
        ]  # fmt: skip
        scheduler = _started(
            stack, spawn("dask-scheduler", hosts.argv("head", scheduler_argv), env, logs)
        )
        wait_until(lambda: tcp_ok(head, SCHEDULER_PORT), 60, scheduler, "listening")
        # Every host's workers, those that add_host started too, stop before the scheduler.
        stack.callback(_stop_all, multi.workers)
        for host in workers_per_host:
            multi.start_workers(host)
        multi.restore(timeout_s=180)
        yield multi


def _stop_all(services: Mapping[str, Service]) -> None:
    for service in list(services.values()):
        stop(service)


def _started(stack: ExitStack, service: Service) -> Service:
    stack.callback(stop, service)
    return service
