"""Checkpoints inside an epoch: where training stands, when to write one, and per-step seeds.

An epoch of a real dataset takes hours, so a failure that resumes from the last epoch's end
loses hours. fit() therefore also writes a checkpoint every `every_steps` steps and, by
default, every `every_s` seconds, and a run resumes from the middle of an epoch exactly:

- the data order of an epoch is a function of (seed, epoch, world size), so a resumed rank
  skips the samples the checkpoint's steps already took (`EpochPosition.samples`);
- torch's RNG (dropout) is reseeded before every step from (seed, rank, epoch, step), so no
  RNG state needs saving and the weights do not depend on where checkpoints fall. This
  draws a different random stream than reseeding once per epoch did (checkpoints written by
  an older ddpflow resume exactly only at their epoch ends, which is all they hold);
- the epoch's partial loss sums (every rank's) and rank 0's logging window are in the
  checkpoint, so the epoch mean and the per-step log lines repeat the uninterrupted run's.

Ranks must agree on the step to checkpoint at (rank 0 writes, the others wait for it).
A step count agrees by itself; a time limit, which each rank measures on its own clock, is
agreed on by a small MAX all-reduce at control points (every `control_every` steps). The same
all-reduce carries a stop request (ddpflow.distributed.supervisor.graceful_stop: a worker sent
SIGTERM): the group checkpoints at that step and every rank raises StopRequested.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ddpflow.distributed.supervisor import graceful_stop
from ddpflow.tracking.loggers import MetricLogger, flush_logger

if TYPE_CHECKING:
    import torch

    from ddpflow.distributed.context import RankContext
    from ddpflow.distributed.supervisor.graceful_stop import StopReason

# Lost work after a failure is bounded by this by default: minutes, not an epoch of hours.
DEFAULT_CHECKPOINT_EVERY_S = 600.0


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """The torch seed at an epoch's start (TrainContext.start_epoch, for users' own loops)."""
    return (seed * 1_000_003 + rank * 7919 + epoch) % (2**63)


def step_seed(seed: int, rank: int, epoch: int, step: int) -> int:
    """The torch seed of one training step of one rank (step counted within the epoch)."""
    return (seed * 1_000_003 + rank * 7919 + epoch * 104_729 + step * 15_485_863) % (2**63)


@dataclass(frozen=True)
class EpochPosition:
    """Where an interrupted epoch stands: what a checkpoint taken inside it records."""

    epoch: int  # the epoch under way, 0-based (= epochs completed)
    step: int  # steps of it done
    samples: int  # samples of its permutation done, over all ranks
    world_size: int  # the order of an epoch depends on it
    loss_sums: list[list[float]]  # per rank: [sum of loss * samples, samples]
    window: dict[str, Any] = field(default_factory=dict)  # rank 0's StepWindow sums
    # The training's optimizer steps so far, whatever the world sizes were (None: a
    # checkpoint written before this was kept).
    global_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EpochPosition:
        return cls(**{k: values[k] for k in cls.__dataclass_fields__ if k in values})

    def loss_sum_for(self, rank: int, world_size: int) -> torch.Tensor:
        """This rank's partial sums to continue from. A different world size (a resume with
        fewer workers) gives rank 0 the total and the others nothing: the mean is kept."""
        # torch is imported where it is used: the flow process imports this module for its
        # settings and starts without torch.
        import torch

        if world_size == self.world_size:
            return torch.tensor(self.loss_sums[rank], dtype=torch.float64)
        if rank == 0:
            return torch.tensor(self.loss_sums, dtype=torch.float64).sum(dim=0)
        return torch.zeros(2, dtype=torch.float64)


@dataclass(frozen=True)
class CheckpointSchedule:
    """When fit() checkpoints inside an epoch. 0 turns a trigger off; both 0: epoch ends only.

    every_steps: every that many steps of an epoch (deterministic, no communication).
    every_s: once that many seconds passed since the last checkpoint, checked every
        `control_every` steps with one MAX all-reduce of a 2-element tensor.
    """

    every_steps: int = 0
    every_s: float = DEFAULT_CHECKPOINT_EVERY_S
    control_every: int = 20

    def __post_init__(self) -> None:
        check_schedule(self.every_steps, self.every_s)
        if self.control_every < 1:
            raise ValueError(f"control_every must be >= 1, got {self.control_every}")


def check_schedule(every_steps: object, every_s: object) -> None:
    """ValueError naming the bad value and the fix, before any work."""
    if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 0:
        raise ValueError(
            f"checkpoint_every_steps={every_steps!r}: pass a whole number of steps >= 0 "
            "(0: no step-count checkpoints)"
        )
    if (
        not isinstance(every_s, int | float)
        or isinstance(every_s, bool)
        or not 0 <= every_s < float("inf")
    ):
        raise ValueError(
            f"checkpoint_every_s={every_s!r}: pass finite seconds >= 0, e.g. 600 "
            "(0: no time-based checkpoints)"
        )


class CheckpointClock:
    """Decides, identically on every rank, whether to checkpoint after a step."""

    def __init__(self, schedule: CheckpointSchedule, world_size: int, device: torch.device):
        self.schedule, self.world_size, self.device = schedule, world_size, device
        self.last = time.monotonic()

    def written(self) -> None:
        self.last = time.monotonic()

    def check(self, steps_done: int) -> tuple[bool, StopReason | None]:
        """After `steps_done` steps of the epoch: (checkpoint now?, why to stop after it or
        None). Every rank calls this after every step: at control points it is a collective.
        """
        every_steps, every_s = self.schedule.every_steps, self.schedule.every_s
        due = every_steps > 0 and steps_done % every_steps == 0
        if steps_done % self.schedule.control_every:
            return due, None
        import torch

        asked = graceful_stop.stop_reason()
        late = every_s > 0 and time.monotonic() - self.last >= every_s
        time_due, stop = (bool(v) for v in self._agree(torch.tensor([late, asked is not None])))
        if not stop:
            return due or time_due, None
        return True, asked or graceful_stop.PEER_STOP

    def stop_requested(self) -> StopReason | None:
        """Why the group stops now, or None: any rank's request is everyone's. A collective:
        every rank calls it at the same point (fit: after each epoch's checkpoint)."""
        import torch

        asked = graceful_stop.stop_reason()
        stop = bool(self._agree(torch.tensor([asked is not None]))[0])
        return (asked or graceful_stop.PEER_STOP) if stop else None

    def _agree(self, flags: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        flags = flags.to(torch.float32)
        if self.world_size > 1:
            moved = flags.to(self.device)
            dist.all_reduce(moved, op=dist.ReduceOp.MAX)  # any rank's "yes" is everyone's
            return moved.cpu()
        return flags


def gather_loss_sums(loss_sum: torch.Tensor, world_size: int, device: torch.device) -> list:
    """Every rank's partial (loss * samples, samples), in rank order, on every rank."""
    import torch
    import torch.distributed as dist

    if world_size == 1:
        return [loss_sum.tolist()]
    parts = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(parts, loss_sum.to(device))
    return [p.cpu().tolist() for p in parts]


@dataclass(frozen=True)
class StepCheckpointer:
    """Checkpoints inside an epoch: when (the clock) and who writes them (rank 0, through
    the workload's `save(epochs_done, position)`)."""

    clock: CheckpointClock
    save: Callable[..., None]

    def write(self, ctx: RankContext, logger: MetricLogger, position: EpochPosition) -> None:
        """Called by every rank at the same step."""
        with ctx.rank0_io("checkpoint"):  # nobody steps on before the checkpoint exists
            if ctx.is_main:
                flush_logger(logger)  # the steps before the checkpoint are never logged again
                self.save(position.epoch, position)
        self.clock.written()
        ctx.heartbeat()
