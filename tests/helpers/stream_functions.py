"""The trainings the streaming tests run through ddpflow.run(), in a module of its own so the
Dask worker processes import it by name: ddpflow.fit on a small CNN with dropout, reading a
sharded split through ddpflow.shards.stream with augmentation on, every rank writing down
the samples of each step; and a rank that streams an epoch and measures its own memory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import ddpflow
from ddpflow.shards.index import read_index, shards_folder, write_index
from ddpflow.shards.shard_file import write_shard
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches
from ddpflow.workloads.vision.augment import AugmentedSamples
from tests.helpers.grow_functions import Recorded, recording_context

CLASSES = 4
SIDE = 16
EPOCHS = 2
BATCH_SIZE = 8  # per rank


def write_split(index_uri: str, num_samples: int, per_shard: int, side: int = SIDE) -> None:
    """A learnable split of `num_samples` images: class c is brighter in its own quarter."""
    generator = np.random.default_rng(0)
    folder = shards_folder(index_uri)
    infos = []
    for lo in range(0, num_samples, per_shard):
        n = min(per_shard, num_samples - lo)
        labels = generator.integers(0, CLASSES, n)
        images = generator.integers(0, 128, (n, 3, side, side), dtype=np.uint8)
        half = side // 2
        for i, label in enumerate(labels):
            top, left = divmod(int(label), 2)
            images[i, :, top * half : (top + 1) * half, left * half : (left + 1) * half] += 100
        infos.append(write_shard(folder, images, labels.tolist()))
    write_index(index_uri, (3, side, side), tuple(infos))


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.3), nn.AdaptiveAvgPool2d(2)
        )
        self.head = nn.Linear(8 * 4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.float() / 255).flatten(1))


def stream_fit(ctx: ddpflow.TrainContext, index_uri: str, log_dir: str, pause: str) -> dict:
    """EPOCHS epochs over the streamed, augmented split, a step checkpoint every 3 steps;
    the trained weights."""
    stream = ShardStream(read_index(index_uri), window=2, prefetch=1, on_wait=ctx.heartbeat)
    data = Recorded(AugmentedSamples(stream, seed=0), Path(pause))
    torch.manual_seed(0)
    net = _SmallCNN()
    val = ShardStream(read_index(index_uri), window=2, prefetch=1)
    ddpflow.fit(
        recording_context(ctx, data, log_dir),  # type: ignore[arg-type]
        model=ctx.wrap(net),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        train=data,
        val=val,
        epochs=EPOCHS,
        batch_size=BATCH_SIZE,
        hooks=ddpflow.FitHooks(loss=nn.functional.cross_entropy),
        log_every_steps=1,
        checkpoint_every_steps=3,
    )
    return {"weights": [p.detach().clone() for p in net.parameters()]}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(field)


def stream_peak(ctx: ddpflow.TrainContext, index_uri: str, batch_size: int, out: str) -> None:
    """Stream this rank's part of one epoch (a step that only waits) and measure, in this worker
    process, how far its resident memory rose above where it started (Linux's peak, VmHWM,
    reset just before); written to `out`/rank<r>.json."""
    stream = ShardStream(read_index(index_uri), window=2, prefetch=1)
    batches = epoch_batches(
        len(stream), batch_size, ctx.rank, ctx.world_size, 0, 0, order=stream.epoch_order
    )
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    start_kb = _status_kb("VmRSS")
    stream.start_epoch(0, batches)
    seen = 0
    for index in batches:
        images, _ = stream.batch(index)
        seen += len(images)
        # A step takes time (here 20 ms): a reader not held back would run ahead of it
        # through the whole dataset.
        time.sleep(0.02)
        ctx.heartbeat()
    peak_kb = _status_kb("VmHWM")
    stream.close()
    rise_mb = (peak_kb - start_kb) / 1024
    measured = {"rise_mb": rise_mb, "samples": seen, "shards": stream.peak_shards}
    (Path(out) / f"rank{ctx.rank}.json").write_text(json.dumps(measured))
