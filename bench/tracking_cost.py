"""Tracking and checkpoint cost: their share of an epoch of the default pet-name training.

    .venv/bin/python -m bench.tracking_cost [--quick]

Per epoch of the default config (shipped corpus, 2 ranks, batch 512 per rank: about 300
steps), rank 0 does, between training steps, what `train_loop.fit` and `train_rank` do:
- every 20 steps `MlflowLogger.log_metrics` of train_loss and samples_per_s, and once per
  epoch 4 epoch metrics, into a SQLite tracking store in a temporary folder;
- once per epoch the checkpoint: `build_state` + `encode` + `CheckpointStore.save_encoded`
  (local artifact folder, keep_last=3) + `record_checkpoint` (copy into the MLflow run, tag).
Each call is timed with time.perf_counter and multiplied by how often an epoch makes it.
The other ranks wait for rank 0 at the next collective, so this time is lost by all ranks.

The baseline is the compute time of an epoch: steps per epoch x the median time of one
ddpflow training step (index slicing, split_xy, forward/backward/Adam), measured here in one
process with one torch thread. A DDP rank's step is a little slower still (it adds a
gradient all-reduce), so the share printed is, if anything, an over-estimate.
The MLflow run is created (and the SQLite schema with it, ~6 s) before any timer starts,
as the flow creates its run before training.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer

from bench.common import BENCH_THREADS, Result, command_line, print_results
from ddpflow.checkpoint.store import CheckpointStore, build_state, encode, record_checkpoint
from ddpflow.tracking.loggers import MlflowLogger
from ddpflow.tracking.run import default_artifact_location, start_run
from ddpflow.training.batching import epoch_batches
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.corpus import load_names, split_holdout
from ddpflow.workloads.charlm.formatting import format_names, split_xy
from ddpflow.workloads.charlm.model import CharLSTM

TARGET_PERCENT = 2.0
BATCH_SIZE = 512
WORLD_SIZE = 2
LOG_EVERY = 20
WARMUP_STEPS = 3


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def steps_per_epoch() -> tuple[int, torch.Tensor]:
    """Steps of one epoch of the default flow, and its training windows."""
    names, _ = load_names()
    train, _ = split_holdout(names, 0.1)
    windows = format_names(train)
    return len(epoch_batches(len(windows), BATCH_SIZE, 0, WORLD_SIZE, 0, 0)), windows


def step_times(
    model: nn.Module, optimizer: Optimizer, windows: torch.Tensor, num_steps: int
) -> list[float]:
    """Seconds per ddpflow training step (what train_loop._train_epoch does per step)."""
    batches = epoch_batches(len(windows), BATCH_SIZE, 0, WORLD_SIZE, 0, 0)
    times = []
    for index in batches[: WARMUP_STEPS + num_steps]:

        def step(index: torch.Tensor = index) -> None:
            x, y = split_xy(windows[index])
            optimizer.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            loss.item()

        times.append(_timed(step))
    return times[WARMUP_STEPS:]


def log_times(logger: MlflowLogger, num_logs: int) -> list[float]:
    metrics = {"train_loss": 1.5, "samples_per_s": 7000.0}
    return [_timed(lambda i=i: logger.log_metrics(metrics, step=20 * i)) for i in range(num_logs)]


def checkpoint_times(
    model: nn.Module, optimizer: Optimizer, logger: MlflowLogger, root: str, num_epochs: int
) -> list[float]:
    """train_rank's save_checkpoint, epoch after epoch (the 4th on also prunes the oldest)."""
    store = CheckpointStore(root, keep_last=3)
    config = CharLSTMConfig().to_dict()

    def save(epoch: int) -> None:
        extra = {"lr": 0.005, "batch_size": BATCH_SIZE, "seed": 0}
        state = build_state(model, optimizer, epoch, config, extra=extra)
        data = encode(state)
        record_checkpoint(logger, store.save_encoded(epoch, data), data)

    return [_timed(lambda e=e: save(e)) for e in range(1, num_epochs + 1)]


def measure(quick: bool) -> dict[str, float]:
    torch.set_num_threads(BENCH_THREADS)
    num_steps, windows = steps_per_epoch()
    torch.manual_seed(0)
    model = CharLSTM(CharLSTMConfig())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
    step_s = statistics.median(step_times(model, optimizer, windows, 10 if quick else 30))
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-tracking-") as tmp:
        project = Path(tmp)
        uri = f"sqlite:///{project / 'mlflow.db'}"
        location = default_artifact_location(uri, project)
        run = start_run(uri, "bench-tracking", "bench", {"bench": 1}, {}, location)
        logger = MlflowLogger(run)
        log_s = statistics.median(log_times(logger, 10 if quick else 30))
        epoch_metrics = {"epoch_train_loss": 1.5, "val_loss": 1.5, "epoch_time_s": 40.0}
        epoch_log_s = _timed(lambda: logger.log_metrics(epoch_metrics, step=1))
        root = str(project / "artifacts" / "checkpoints")
        ckpt_s = statistics.median(
            checkpoint_times(model, optimizer, logger, root, 2 if quick else 4)
        )
    return {
        "steps_per_epoch": num_steps,
        "step_s": step_s,
        "compute_s": num_steps * step_s,
        "log_s": log_s,
        "logging_s": (num_steps // LOG_EVERY) * log_s + epoch_log_s,
        "checkpoint_s": ckpt_s,
    }


def _row(figure: str, overhead_s: float, m: dict[str, float], notes: str, target: bool) -> Result:
    share = 100 * overhead_s / m["compute_s"]
    return Result(
        "tracking cost",
        figure,
        overhead_s,
        m["compute_s"],
        "s/epoch",
        share,
        f"overhead/compute <= {TARGET_PERCENT:g} %" if target else "overhead/compute (info)",
        share <= TARGET_PERCENT if target else None,
        notes,
        m if target else {},
        percent=True,
    )


def run(quick: bool = False) -> list[Result]:
    m = measure(quick)
    per_epoch = f"{m['steps_per_epoch']} steps x {m['step_s'] * 1000:.0f} ms"
    return [
        _row(
            "metric logging",
            m["logging_s"],
            m,
            f"{m['steps_per_epoch'] // LOG_EVERY} x log_metrics at {m['log_s'] * 1000:.1f} ms "
            f"+ 1 epoch log; epoch = {per_epoch}",
            target=False,
        ),
        _row("checkpoint", m["checkpoint_s"], m, "save + copy into MLflow run", target=False),
        _row("logging + checkpoint", m["logging_s"] + m["checkpoint_s"], m, "", target=True),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.tracking_cost", __doc__, quick="fewer timed calls")
    args = parser.parse_args(argv)
    print_results("tracking and checkpoint cost", run(args.quick))


if __name__ == "__main__":
    main()
