"""An image training job: what every rank needs, as URIs and numbers, free of torch.

The flows build it in a process that starts without torch (importing it would add seconds to every
run's start); ddpflow.workloads.vision.training.train_rank runs it on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpflow.checkpoint.steps import DEFAULT_CHECKPOINT_EVERY_S
from ddpflow.shards.settings import StreamSettings
from ddpflow.tracking.loggers import RunRef
from ddpflow.training.settings import TrainSettings, workload_settings
from ddpflow.training.speed.settings import PLAIN, SpeedSettings
from ddpflow.workloads.vision.config import ImageModelConfig

Optimizer = Literal["adam", "sgd"]


@dataclass(frozen=True)
class ImageTrainJob:
    """Everything a rank needs, as URIs and numbers (it crosses the network to each worker)."""

    train_uri: str
    val_uri: str
    model: ImageModelConfig
    weights_uri: str | None  # a state_dict checked by resolve_weights, or None
    epochs: int
    batch_size: int  # per rank; the group's with global_batch
    lr: float  # base lr: lr * world_size (linear scaling), or as it is with global_batch
    optimizer: Optimizer
    lr_patience: int
    seed: int
    checkpoint_root: str
    keep_last: int
    run: RunRef
    log_every_steps: int = 5
    eval_batch_size: int = 256
    speed: SpeedSettings = PLAIN
    # Checkpoints inside an epoch (ddpflow.checkpoint.steps); 0 turns a trigger off.
    checkpoint_every_steps: int = 0
    checkpoint_every_s: float = DEFAULT_CHECKPOINT_EVERY_S
    # batch_size is the group's batch per step, whatever the world size (ddpflow.fit).
    global_batch: bool = False
    # Random resized crop and flip of training images, seeded by (seed, epoch, sample).
    augment: bool = False
    # How a streamed (sharded) split is read (ddpflow.shards.stream).
    stream: StreamSettings = StreamSettings()

    def train_settings(self) -> TrainSettings:
        """What every rank's TrainContext is made of (checkpoint folder, seed, MLflow run)."""
        return workload_settings(self.checkpoint_root, self.keep_last, self.seed, self.run.run_id)
