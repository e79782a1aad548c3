"""The launcher leaves the long-lived workers' environment as it found it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ddpflow.distributed import RankContext, launch

pytestmark = pytest.mark.integration


def _environment() -> dict[str, str]:
    return dict(os.environ)


def _all_reduce(ctx: RankContext) -> float:
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    return float(value)


def test_a_launch_changes_no_environment_variable_on_the_workers(dask_client):
    # README "Layout"/docs/multi-host.md: init_process_group gets an explicit tcp:// init
    # method, and no environment variable (MASTER_ADDR, RANK, GLOO_SOCKET_IFNAME...) is set on
    # the workers, so one group's settings never leak into the next group on those workers.
    before = dask_client.run(_environment)
    assert launch(dask_client, _all_reduce, world_size=2, timeout_s=60) == [2.0, 2.0]
    after = dask_client.run(_environment)
    assert after == before
