"""One streamed image rank's validation, in a process of its own, for
test_validation_memory.py: `python -m tests.helpers.validation_memory INDEX_URI
BATCH_SIZE NUM_CLASSES` prints, as JSON, the process's peak RSS (KiB, the kernel's high-water
mark) before and after ddpflow's image validation (evaluate_split) of that split.

The mark is VmHWM from /proc/self/status, not getrusage's ru_maxrss: Linux carries
ru_maxrss across exec, so a child of a big process (a pytest worker holding 2 GB) starts with
its parent's peak and a validation below it would add nothing.

The stream holds one shard and reads one ahead (STREAM): its defaults (a shuffle window of 4
shards, 2 read ahead, 256 MiB of ranged reads) hold more shards than the 1x split has, so the
4x split's peak was higher by the shards the stream held, up to 3 MiB depending on how far
the reads got ahead on a loaded machine: the stream's bound, not the validation's."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from ddpflow.distributed.context import RankContext
from ddpflow.shards.settings import StreamSettings
from ddpflow.workloads.vision.data import open_split
from ddpflow.workloads.vision.metrics import evaluate_split
from ddpflow.workloads.vision.model import build_resnet

STREAM = StreamSettings(window=1, prefetch=1, requests_in_flight=1)


def peak_kib() -> int:
    """This process's own high-water RSS in KiB (its memory map's, reset at exec)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1))


def main(index_uri: str, batch_size: int, num_classes: int) -> None:
    torch.set_num_threads(1)  # as a rank on a one-thread Dask worker
    torch.manual_seed(0)
    model = build_resnet("resnet18", num_classes)
    split = open_split(index_uri, STREAM)  # streamed from its shards, as a sharded split's rank
    ctx = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="none")
    before = peak_kib()
    metrics = evaluate_split(model, split, ctx, batch_size)
    print(json.dumps({"before_kib": before, "after_kib": peak_kib(), **metrics}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
