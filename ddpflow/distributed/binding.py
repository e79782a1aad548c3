"""Gloo bound to a given address: the one the rank's Dask worker listens on.

Stock gloo picks its address from the machine's host name. /etc/hosts often maps that name
to loopback (127.0.0.1 in containers, 127.0.1.1 on Debian and Ubuntu), so a rank advertises
loopback to ranks on other hosts and the group never connects ("Gloo connectFullMesh failed
... remote=[127.0.0.1]"). GLOO_SOCKET_IFNAME would fix it, but Dask workers are long-lived
processes shared by many runs, so nothing here touches the environment: the address goes to
gloo as a device in the group's options instead, through a backend registered under its own
name that builds a stock ProcessGroupGloo with that device.

NCCL's bootstrap does not use the host name (it skips loopback and docker interfaces by
default) and reads its interface only from NCCL_SOCKET_IFNAME, which must be in the worker's
environment when it starts (ddpflow.cluster.build.nccl_interface_env for the jobs it submits).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: the flow process imports this package
    from torch.distributed import ProcessGroupGloo

BOUND_GLOO = "ddpflow_gloo"
_registered = threading.Lock()


def bound_gloo_options(host: str, timeout: timedelta) -> ProcessGroupGloo._Options:
    """Gloo options whose one device binds `host` (an IP or a name that resolves to one)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
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


def _create_bound_gloo(opts, options: ProcessGroupGloo._Options | None) -> ProcessGroupGloo:  # noqa: ANN001
    from torch.distributed import ProcessGroupGloo

    if options is None:
        raise ValueError(f"the {BOUND_GLOO} backend needs pg_options=bound_gloo_options(...)")
    options._timeout = opts.timeout  # init_process_group's timeout is the one that counts
    group = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
    group.options.global_ranks_in_group = opts.global_ranks_in_group
    group.options.group_name = opts.group_id
    return group
