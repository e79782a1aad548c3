"""What a user's training function gets on every rank: `train(ctx, *args)`.

A thin layer over the launcher's RankContext that adds the parts every training repeats:
metric logging (rank 0 only), checkpoints with exact resume (at an epoch's end or inside
one), per-epoch reseeding and data sharding. It holds no config of its own beyond what
ddpflow.run() hands each rank. The built-in workloads run on it too, through ddpflow.fit().
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, overload

import distributed
import torch
from torch import nn

from ddpflow.checkpoint.steps import EpochPosition, epoch_seed
from ddpflow.checkpoint.store import (
    CheckpointStore,
    Stateful,
    check_info,
    pack_state,
    resume_from,
    write_checkpoint,
)
from ddpflow.distributed.context import RankContext
from ddpflow.distributed.progress import Progress
from ddpflow.tracking.loggers import MetricLogger, NullLogger, flush_logger
from ddpflow.training.batching import epoch_batches
from ddpflow.training.settings import TrainSettings

__all__ = ["Stateful", "TrainContext", "TrainSettings"]
T = TypeVar("T")


class TrainContext:
    """The rank's view of its DDP group, passed as the first argument of `train(ctx, ...)`."""

    def __init__(
        self, rank_ctx: RankContext, settings: TrainSettings, logger: MetricLogger | None = None
    ):
        self._rank_ctx = rank_ctx
        self._settings = settings
        self._logger = logger or NullLogger()
        self._store = (
            CheckpointStore(settings.checkpoint_dir, settings.keep_last)
            if settings.checkpoint_dir
            else None
        )

    @property
    def rank(self) -> int:
        return self._rank_ctx.rank

    @property
    def world_size(self) -> int:
        return self._rank_ctx.world_size

    @property
    def device(self) -> torch.device:
        """cpu with gloo; cuda:0 with nccl (each GPU worker sees only its own GPU)."""
        return self._rank_ctx.device

    @property
    def is_main(self) -> bool:
        return self._rank_ctx.is_main

    @property
    def seed(self) -> int:
        return self._settings.seed

    @property
    def run_id(self) -> str | None:
        """The MLflow run this training logs into, or None when it is not tracked."""
        return self._settings.run_id

    @property
    def worker_address(self) -> str | None:
        """The address of the Dask worker this rank runs in (None: not in a Dask worker)."""
        try:
            return distributed.get_worker().address
        except ValueError:  # no worker in this thread: a rank started some other way
            return None

    @property
    def pid(self) -> int:
        """This rank's process id: to watch, profile or signal the rank."""
        return os.getpid()

    def report(self, message: str) -> None:
        """A progress line for whoever called ddpflow.run() (its `on_progress`, the Prefect
        log). Every rank may send; send from rank 0 to get each line once."""
        self._rank_ctx.report(message)

    def send_progress(self, progress: Progress) -> None:
        """A progress event for ddpflow.run()'s subscribers: a line (`on_progress` gets it),
        step counts (`on_event` gets them; run_in_flow shows them as its progress artifact),
        or both. ddpflow.fit sends its own; a loop of yours may send step counts the same
        way. It goes on the same channel as report() and never blocks or fails the rank."""
        self._rank_ctx.send(progress)

    def heartbeat(self, step: int | None = None) -> None:
        """Say this rank is alive. save_checkpoint() beats by itself; call it at least once
        per `timeout_s` of ddpflow.run() (e.g. every step) or the group is failed as hung.
        `step` (the global training step just done) lets a restart tell whether training
        had begun."""
        self._rank_ctx.heartbeat(step)

    @property
    def rank_context(self) -> RankContext:
        """The launcher's view of the rank (for ddpflow's own loops: fit, evaluation)."""
        return self._rank_ctx

    @property
    def metric_logger(self) -> MetricLogger:
        """Rank 0's MLflow logger (tags, artifacts); a no-op elsewhere and when untracked."""
        return self._logger

    @property
    def can_checkpoint(self) -> bool:
        """Whether the training has a checkpoint folder (ddpflow.run's checkpoint_dir)."""
        return self._store is not None

    @property
    def latest_checkpoint(self) -> str | None:
        """The URI of the newest complete checkpoint, or None (none yet, or no folder)."""
        return self._store.latest_uri() if self._store is not None else None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """To the MLflow run on rank 0, in the background; a no-op on other ranks and when
        the training is not tracked. After a restart, steps already logged are skipped."""
        self._logger.log_metrics(metrics, step=step)

    def reseed(self, epoch: int) -> None:
        """Seed torch's RNG from (seed, rank, epoch): call at the start of each epoch so that
        dropout and other random ops after a resume repeat the uninterrupted run's."""
        torch.manual_seed(epoch_seed(self.seed, self.rank, epoch))

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model on this rank's device, in DistributedDataParallel."""
        model = model.to(self.device)
        ids = [self.device.index or 0] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    @overload
    def shard(self, data: int) -> torch.Tensor: ...
    @overload
    def shard(self, data: torch.Tensor) -> torch.Tensor: ...
    @overload
    def shard(self, data: Sequence[T]) -> list[T]: ...
    def shard(self, data: Any) -> Any:
        """This rank's fixed, disjoint part: every world_size-th item from `rank`.

        `data` is a count (gives the indices), a tensor (gives its rows) or a sequence /
        map-style dataset (gives a list). Parts differ by at most one item: fine for
        evaluation; for training use batches(), whose ranks always take equal steps.
        """
        if isinstance(data, int) and not isinstance(data, bool):
            return torch.arange(self.rank, data, self.world_size)
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise TypeError(
                f"shard(data) takes a count, a tensor or a sequence, got {type(data).__name__}"
            )
        index = torch.arange(self.rank, len(data), self.world_size)
        if isinstance(data, torch.Tensor):
            return data[index]
        return [data[int(i)] for i in index]

    def batches(self, num_samples: int, batch_size: int, epoch: int) -> list[torch.Tensor]:
        """This rank's index batches for one epoch: one shuffle per (seed, epoch) shared by
        all ranks, each sample once per epoch across ranks, and the same number of steps
        on every rank (DDP waits forever for a rank that skips a step)."""
        return epoch_batches(num_samples, batch_size, self.rank, self.world_size, self.seed, epoch)

    def save_checkpoint(
        self,
        step: int,
        *,
        position: EpochPosition | None = None,
        info: Mapping[str, Any] | None = None,
        **objects: Stateful,
    ) -> None:
        """Checkpoint after `step` (an epoch or step count, >= 1): call on EVERY rank.

        Rank 0 writes the state_dict of each named object (model, optimizer, scheduler...)
        and the plain values of `info` into one file, then moves the `latest` pointer to it;
        no rank returns before it is written, so a restart always finds it. Objects in
        DistributedDataParallel are saved unwrapped. A checkpoint at an epoch's end is also
        copied into the MLflow run; one inside an epoch (`position`, from ddpflow.fit) is not.
        """
        self._require_store("save_checkpoint")
        if step < 1:
            raise ValueError(f"save_checkpoint(step={step}): step must be >= 1")
        if not objects:
            raise ValueError("save_checkpoint() got nothing to save: pass e.g. model=model")
        check_info(info)  # on every rank, before any waits for rank 0's write
        with self._rank_ctx.rank0_io("checkpoint"):
            if self.is_main:
                # Logging calls made before the checkpoint reach MLflow first, so a resume
                # never logs them twice.
                flush_logger(self._logger)
                self.write_checkpoint(step, objects, position=position, info=info)
        self.heartbeat()

    def write_checkpoint(
        self,
        step: int,
        objects: Mapping[str, Stateful],
        *,
        position: EpochPosition | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> str:
        """Rank 0's part of save_checkpoint(), for loops that already hold the other ranks
        and flush the logger first (ddpflow.fit does both inside its own rank0_io wait)."""
        store = self._require_store("save_checkpoint")
        state = pack_state(step, objects, info)
        return write_checkpoint(store, self._logger, step, state, position)

    def resume(self, **objects: Stateful) -> int:
        """Load the latest checkpoint into the named objects; returns its step (0: none).

        Call on every rank with the same names that save_checkpoint() got, before
        training: continue with step + 1 (or epoch `step` counted from 0).
        """
        return self.resume_position(**objects)[0]

    def resume_position(self, **objects: Stateful) -> tuple[int, EpochPosition | None]:
        """resume(), plus where inside the next epoch the checkpoint was taken (None: at
        an epoch's end), for loops that checkpoint inside epochs (ddpflow.fit)."""
        return self.resume_checkpoint(**objects)[:2]

    def resume_checkpoint(
        self, **objects: Stateful
    ) -> tuple[int, EpochPosition | None, dict[str, Any]]:
        """resume_position(), plus the plain `info` values the checkpoint holds ({}: none)."""
        if self._store is None:
            return 0, None, {}
        return resume_from(self._store, objects)

    def _require_store(self, what: str) -> CheckpointStore:
        if self._store is None:
            raise ValueError(
                f"{what}() needs a checkpoint folder: pass checkpoint_dir=<folder or s3:// URI> "
                "to ddpflow.run()"
            )
        return self._store
