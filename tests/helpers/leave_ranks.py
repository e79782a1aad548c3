"""A rank function for the graceful-leave tests: steps with fit()'s stop check, in a module
of its own so that Dask worker processes import it by name."""

from __future__ import annotations

import time
from pathlib import Path

import distributed

from ddpflow.checkpoint.steps import CheckpointClock, CheckpointSchedule
from ddpflow.distributed import RankContext
from ddpflow.distributed.supervisor.graceful_stop import StopRequested

CONTROL_EVERY = 20


def steps_until_asked(ctx: RankContext, state_dir: str, steps: int, step_s: float) -> int:
    """`steps` steps of `step_s`, from the step the last stop recorded. Every CONTROL_EVERY
    steps the group agrees on a stop request as fit() does; rank 0 then records the step
    (the "checkpoint") and every rank raises StopRequested. Returns the step it started at.
    Each rank notes its worker's address and its step in `state_dir` for the test."""
    state = Path(state_dir)
    marker = state / "stopped-at"
    start = int(marker.read_text()) if marker.exists() else 0
    (state / f"rank{ctx.rank}-worker").write_text(distributed.get_worker().address)
    schedule = CheckpointSchedule(every_s=0, control_every=CONTROL_EVERY)
    clock = CheckpointClock(schedule, ctx.world_size, ctx.device)
    for step in range(start + 1, steps + 1):
        time.sleep(step_s)
        ctx.heartbeat(step)
        (state / f"rank{ctx.rank}-step").write_text(str(step))
        _, stop = clock.check(step)
        if stop is not None:
            with ctx.rank0_io("checkpoint"):
                if ctx.is_main:
                    marker.write_text(str(step))
            raise StopRequested(stop, step=step)
    return start
