"""A two-rank gloo group, set up as the launcher's ranks set theirs up, in which one rank
fails on purpose: killed, hung, raising, or killed while its peer waits for its checkpoint.
In a module of its own, so spawned processes import it by name."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.queues import Queue

FAIL_AT_STEP = 3
# A rank that raised stays alive, as a Dask worker does after its task failed: its peer
# then sees the group closed, not a process gone.
RAISED_RANK_LIVES_S = 10.0


def run_rank(rank: int, port: int, failure: str, victim: int, timeout_s: float, out: Queue) -> None:
    """Rank `rank` of the group; rank `victim` fails with `failure` at step FAIL_AT_STEP.
    Each rank that catches an exception puts (rank, the exception) on `out`."""
    import torch
    import torch.distributed as dist

    from ddpflow.distributed.context import RankSpec, process_group

    torch.set_num_threads(1)
    spec = RankSpec(
        rank, 2, "127.0.0.1", port, "gloo", timeout_s, "classify", "127.0.0.1", "t" * 32
    )
    try:
        with process_group(spec) as ctx:
            for step in range(1000):
                if rank == victim and step == FAIL_AT_STEP:
                    _fail(failure)
                dist.all_reduce(torch.ones(4))
                if failure == "killed-in-checkpoint" and step == FAIL_AT_STEP:
                    with ctx.rank0_io("checkpoint"):
                        if rank == victim:
                            os.kill(os.getpid(), signal.SIGKILL)
                        time.sleep(0.2)
                time.sleep(0.01)
    except Exception as error:  # noqa: BLE001 - what the test classifies
        out.put((rank, error))
        if rank == victim:
            time.sleep(RAISED_RANK_LIVES_S)


def _fail(failure: str) -> None:
    if failure == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    elif failure == "hung":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif failure == "raised":
        raise ValueError("rank fails on purpose")
