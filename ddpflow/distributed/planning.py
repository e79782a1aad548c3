"""Which Dask worker runs which rank: a pure function, so it is unit-tested without a cluster."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class PlanError(ValueError):
    """The cluster cannot host the requested rank group; the message says how to fix it."""


@dataclass(frozen=True)
class RankAssignment:
    rank: int
    worker_address: str
    host: str
    num_threads: int


def worker_host(address: str) -> str:
    """The host part of a Dask worker address such as tcp://10.0.0.5:40123."""
    host = urlsplit(address).hostname
    if not host:
        raise PlanError(f"cannot read a host from Dask worker address {address!r}")
    return host


def plan_ranks(
    workers: Mapping[str, Mapping[str, Any]],
    world_size: int | None,
    exclude: frozenset[str] = frozenset(),
) -> list[RankAssignment]:
    """One rank per worker, in address order so a plan is reproducible for the same cluster.

    `workers` is `cluster_workers(client)`: address -> info (with "nthreads").
    `world_size=None` means every available worker.
    """
    available = sorted(addr for addr in workers if addr not in exclude)
    if world_size is None:
        world_size = len(available)
    if world_size < 1:
        raise PlanError(f"world_size={world_size} is invalid; use 1 or more ranks")
    if world_size > len(available):
        raise PlanError(
            f"world_size={world_size} needs {world_size} Dask workers but the cluster has "
            f"{len(available)} ({', '.join(available) or 'none'}); lower world_size or add "
            "workers (DDPFLOW_DASK_WORKERS for the local cluster)"
        )
    return [
        RankAssignment(
            rank=rank,
            worker_address=addr,
            host=worker_host(addr),
            num_threads=int(workers[addr].get("nthreads", 1)),
        )
        for rank, addr in enumerate(available[:world_size])
    ]


def workers_with_resources(
    workers: Mapping[str, Mapping[str, Any]],
    resources: Mapping[str, float],
    world_size: int | None = None,
) -> dict[str, Mapping[str, Any]]:
    """The workers whose declared Dask resources cover `resources` (e.g. {"GPU": 1}).

    Workers declare resources when they start (`dask worker ... --resources GPU=1`); the
    scheduler reports them in `scheduler_info()["workers"][addr]["resources"]`.
    """
    matching = {
        addr: info
        for addr, info in workers.items()
        if all((info.get("resources") or {}).get(k, 0) >= v for k, v in resources.items())
    }
    needed = 1 if world_size is None else world_size
    if len(matching) < needed:
        wanted = dict(resources)
        raise PlanError(
            f"{'world_size=' + str(world_size) if world_size else 'the DDP group'} needs "
            f"{needed} Dask worker(s) with resources {wanted}, but {len(matching)} of the "
            f"{len(workers)} workers declare them ({', '.join(sorted(matching)) or 'none'}). "
            f"Start workers with `dask worker SCHEDULER --resources "
            f"{','.join(f'{k}={v:g}' for k, v in wanted.items())}`, lower world_size, or "
            "ask for fewer resources (DDPFLOW_RANK_RESOURCES)"
        )
    return matching


def choose_backend(cuda_by_worker: Mapping[str, bool]) -> str:
    """nccl when every rank has a GPU, gloo when none has; a mixed group cannot work."""
    flags = set(cuda_by_worker.values())
    if flags == {True}:
        return "nccl"
    if flags <= {False}:
        return "gloo"
    with_gpu = sorted(a for a, has in cuda_by_worker.items() if has)
    without = sorted(a for a, has in cuda_by_worker.items() if not has)
    raise PlanError(
        f"mixed rank group: workers {with_gpu} have a GPU but {without} do not; NCCL needs a "
        "GPU on every rank. Run ranks only on GPU workers (resources) or only on CPU workers."
    )
