"""The process group a rank lives in, set up and torn down explicitly.

Dask workers are long-lived processes that run many tasks, so nothing here touches
os.environ: the init method, rank, world size and timeout are passed to
init_process_group directly, and the group is destroyed in `finally` even on error.

Gloo is bound to the address the rank's Dask worker listens on. Stock gloo picks its address
from the machine's host name. /etc/hosts often maps that name to loopback (127.0.0.1 in
containers, 127.0.1.1 on Debian and Ubuntu), so a rank advertises loopback to ranks on other
hosts and the group never connects ("Gloo connectFullMesh failed ... remote=[127.0.0.1]").
GLOO_SOCKET_IFNAME would fix it, but Dask workers are long-lived processes shared by many
runs, so nothing here touches the environment: the address goes to gloo as a device in the
group's options instead, through a backend registered under its own name that builds a stock
ProcessGroupGloo with that device.

NCCL's bootstrap does not use the host name (it skips loopback and docker interfaces by
default) and reads its interface only from NCCL_SOCKET_IFNAME, which must be in the worker's
environment when it starts (ddpflow.cluster.build.nccl_interface_env for the jobs it submits).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from ddpflow.config import store_outage_s
from ddpflow.distributed.group_store import open_group_store, token_kept_out_of_errors
from ddpflow.distributed.main_io import MainIO, rank0_io
from ddpflow.distributed.progress import Progress, progress_topic, send_progress
from ddpflow.distributed.supervisor import heartbeats

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _DistributedBackendOptions
    from torch.distributed import ProcessGroupGloo

BOUND_GLOO = "ddpflow_gloo"
_registered = threading.Lock()


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to join its group; small and picklable."""

    rank: int
    world_size: int
    master_host: str
    master_port: int
    backend: str
    timeout_s: float
    launch_id: str
    # The address this rank's own connections bind to: its Dask worker's host. None leaves
    # gloo to pick one from the host name (fine on one machine, wrong across hosts).
    bind_host: str | None = None
    # The launch's secret that seals the group's store (group_store.py); out of the repr,
    # which Dask logs with a failed task's arguments. None: names and values in the clear
    # (a group set up by hand, e.g. a test or a bench on 127.0.0.1).
    store_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    # The one Dask event topic the launcher follows for this group's progress (None: nobody
    # listens).
    progress_topic: str | None = None
    launch_id: str | None = None  # None: no launcher watches this rank's progress
    # The group's store, through which the others wait for rank 0's IO (None: a plain
    # barrier; a group of one, or one set up outside process_group()).
    main_io: MainIO | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0 owns IO: MLflow logging and checkpoint writes."""
        return self.rank == 0

    def heartbeat(self, step: int | None = None) -> None:
        """Note progress: call after each training step, and inside any long phase between
        steps (validation). A rank without one for longer than the group's timeout fails the
        group. A dict write on this worker, no network: cheap enough for every step.
        `step`: the global training step just done, kept for heartbeats.rank_steps()."""
        if self.launch_id is not None:
            heartbeats.heartbeat(self.launch_id, self.rank, step)

    def rank0_io(self, what: str) -> AbstractContextManager[None]:
        """Around rank 0's IO (a checkpoint write), entered on every rank: nobody leaves
        before it is done, and the others wait beating, however long rank 0 retries."""
        return rank0_io(self.main_io, self.rank, self.world_size, what, self.heartbeat)

    def report(self, message: str) -> None:
        """A progress line for whoever launched the group (the flow's log), sent as a Dask
        event; it never blocks or fails the rank."""
        self.send(Progress(line=message))

    def send(self, progress: Progress) -> None:
        """A progress event (a line, step counts or both) for the launcher's subscribers, on
        the group's one progress topic; it never blocks or fails the rank."""
        send_progress(self.progress_topic, progress)


@contextmanager
def process_group(spec: RankSpec) -> Iterator[RankContext]:
    """Join the group described by `spec`; a single rank is just a group of one."""
    # torch is imported where it is used, here and below: the flow process imports this
    # package (the launcher) and starts without torch.
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        # A previous task on this worker died without cleaning up; its group is useless.
        dist.destroy_process_group()
    _reset_group_names()
    with token_kept_out_of_errors(spec.store_token):
        timeout = timedelta(seconds=spec.timeout_s)
        backend, options = spec.backend, None
        if spec.backend == "gloo" and spec.bind_host:
            backend, options = register_bound_gloo(), bound_gloo_options(spec.bind_host, timeout)
        # The store the ranks meet through, made here as torch's tcp:// rendezvous makes it
        # (rank 0 serves it), because the ranks also use it to wait for rank 0's IO (main_io).
        # Every key below, gloo's and main_io's, is under the launch's token.
        store = open_group_store(
            spec.master_host,
            spec.master_port,
            spec.world_size,
            is_master=spec.rank == 0,
            timeout=timeout,
            token=spec.store_token,
        )
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore("default_pg", store),  # the prefix tcp:// init adds too
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
            pg_options=options,
        )
        wait_until_all_joined(store, spec.rank, spec.world_size, timeout)
        # The others wait for rank 0 as long as it may retry a write, plus one group timeout.
        main_io = MainIO(store, bound_s=store_outage_s() + spec.timeout_s)
        try:
            # dask-cuda gives each worker its own CUDA_VISIBLE_DEVICES, so its GPU is cuda:0.
            device = torch.device("cuda:0" if spec.backend == "nccl" else "cpu")
            topic = progress_topic(spec.launch_id)
            yield RankContext(
                spec.rank, spec.world_size, device, spec.backend, topic, spec.launch_id, main_io
            )
        finally:
            dist.destroy_process_group()


def wait_until_all_joined(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> None:
    """Return once every rank's init_process_group has returned.

    gloo's join can return on one side of a connection before the other side finished its
    handshake: a rank whose function then ended at once left the group while a slower peer
    was still connecting to it, and that peer's join failed ("Connection closed by peer";
    seen when a relaunch's replacement worker started slower than its peer). Rank 0 serves
    the store, so it also waits until every other rank made its last call here.
    """
    if world_size < 2:
        return
    store.set(f"joined/{rank}", "1")
    store.wait([f"joined/{r}" for r in range(world_size)], timeout)
    if rank == 0:
        store.wait([f"through/{r}" for r in range(1, world_size)], timeout)
    else:
        store.set(f"through/{rank}", "1")


def _reset_group_names() -> None:
    """Start torch's process-group naming afresh, as in a new process.

    torch names a default group by a per-process counter and resets it only when a default
    group is destroyed. An init that failed (a rendezvous that timed out, a peer that could
    not connect) leaves it advanced, so this long-lived worker's next group would get
    another name than its peers' and they would wait for each other's keys in the store
    until the timeout. torch has no public call for this, hence the guarded private one.
    """
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def find_free_port() -> int:
    """A TCP port free right now on this host, for a group set up by hand (a bench, a test);
    the launcher reserves its groups' ports instead (group_store.reserve_store_port)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ProcessGroupGloo._Options (the binding a backend's pg_options takes, with _devices and
# _timeout) is missing from torch's stubs, which know only its public Options.
def bound_gloo_options(host: str, timeout: timedelta) -> ProcessGroupGloo._Options:  # type: ignore[name-defined]
    """Gloo options whose one device binds `host` (an IP or a name that resolves to one)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return options


def register_bound_gloo() -> str:
    """Register the bound-gloo backend in this process once; returns its name."""
    import torch.distributed as dist

    with _registered:
        if BOUND_GLOO.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(
                BOUND_GLOO,
                _create_bound_gloo,
                extended_api=True,
                devices=["cpu"],
            )
    return BOUND_GLOO


def _create_bound_gloo(
    opts: _DistributedBackendOptions,
    options: ProcessGroupGloo._Options | None,  # type: ignore[name-defined]  # see above
) -> ProcessGroupGloo:
    from torch.distributed import ProcessGroupGloo

    if options is None:
        raise ValueError(f"the {BOUND_GLOO} backend needs pg_options=bound_gloo_options(...)")
    options._timeout = opts.timeout  # init_process_group's timeout is the one that counts
    group = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
    group.options.global_ranks_in_group = opts.global_ranks_in_group
    group.options.group_name = opts.group_id
    return group
