"""The settings every rank's TrainContext is made of, free of torch.

ddpflow.run() and the built-in workloads' jobs build them in the launching process (a flow
process starts without torch: importing it would add seconds to every run's start); each
rank makes its `ddpflow.training.context.TrainContext` from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpflow.training.batching import MAX_SEED


@dataclass(frozen=True)
class TrainSettings:
    """What ddpflow.run() hands every rank besides the user's arguments; small and picklable."""

    checkpoint_dir: str | None = None
    keep_last: int = 3
    seed: int = 0
    run_id: str | None = None
    # Where rank 0's logging calls wait during an MLflow outage: beside this checkpoint
    # folder (ddpflow.tracking.run.spool_folder); None: a temporary folder.
    spool_beside: str | None = None


def workload_settings(
    checkpoint_root: str, keep_last: int, seed: int, run_id: str
) -> TrainSettings:
    """A built-in workload's settings: the waiting logging calls beside the run's
    checkpoints."""
    return TrainSettings(
        checkpoint_dir=checkpoint_root,
        keep_last=keep_last,
        seed=seed,
        run_id=run_id,
        spool_beside=checkpoint_root,
    )


def check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r} must be an int from 0 to {MAX_SEED}")
