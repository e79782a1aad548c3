"""What a training returns, free of torch: the flow process unpickles it when training ends
and has not imported torch (importing it would add seconds to every run's start)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpflow.tracking.spool import Unsent


@dataclass(frozen=True)
class EpochStats:
    epoch: int
    train_loss: float
    val_loss: float
    samples_per_s: float
    epoch_time_s: float
    val_metrics: dict[str, float] = field(default_factory=dict)  # besides val_loss (hooks)
    # The global step after the epoch's last (the training's optimizer steps so far, at
    # whatever world sizes): a resume after this epoch numbers its steps on from here.
    last_step: int | None = None
    # The epoch's steps done before this attempt resumed inside it (a checkpoint inside the
    # epoch, counted in this attempt's world size), None: it ran whole. samples_per_s and
    # epoch_time_s then count the steps since the resume only.
    resumed_at_step: int | None = None


@dataclass(frozen=True)
class TrainResult:
    """What one rank of a workload's training returns (both built-in workloads)."""

    rank: int
    history: list[EpochStats]
    latest_checkpoint: str | None  # rank 0's; None on the other ranks
    # Rank 0's logging calls MLflow had not taken when training ended (ddpflow.tracking.spool).
    unsent: tuple[Unsent, ...] = ()
    # The group's sizes over the whole training, in order, the last the one it ended at
    # (the launcher's record: set by the flows' train-ddp task; empty on the ranks).
    world_sizes: tuple[int, ...] = ()
