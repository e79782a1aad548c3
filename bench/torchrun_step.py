"""The torchrun baseline of the launch benchmark: ddpflow's training step with a bare launch.

    BENCH_LAUNCH_TS=$(date +%s.%N) .venv/bin/torchrun --standalone --nproc_per_node=2 \
        bench/torchrun_step.py [--source names.json] [--epochs 1]

Same data path (clean, split by name, uint8 windows), same model, batch, seed, index batches
and step as the flow's ranks, but launched by torchrun: no Prefect, no Dask, no MLflow and no
checkpoint. The epoch loop copies `train_loop._train_epoch` line for line instead of calling
`fit`, because importing `ddpflow.training.loop` imports MLflow (about 1 s per process), which a
bare launch would not pay. Keep the two in step.

Rank 0 prints one JSON line: the launch timestamp (BENCH_LAUNCH_TS, seconds since the epoch,
taken by whoever started torchrun), the wall-clock time of its first completed step, and for
every `log_every_steps` window the time and samples/s that fit would have sent to MLflow.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpflow.training.batching import epoch_batches
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH, load_names, split_holdout
from ddpflow.workloads.charlm.formatting import format_names, split_xy
from ddpflow.workloads.charlm.model import CharLSTM


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", default=str(DEFAULT_CORPUS_PATH))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--holdout-fraction", type=float, default=0.1)
    parser.add_argument("--log-every-steps", type=int, default=20)
    return parser.parse_args(argv)


def _train_windows(source: str, holdout_fraction: float) -> torch.Tensor:
    names, _ = load_names(source)
    train, _ = split_holdout(names, holdout_fraction)
    return format_names(train)


def _epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: torch.Tensor,
    args: argparse.Namespace,
    epoch: int,
    records: list[dict[str, float]],
) -> float:
    """train_loop._train_epoch's body, with rank 0's log call replaced by a record."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model.train()
    loss_sum = torch.zeros(2, dtype=torch.float64)
    window_loss, window_samples, window_start = 0.0, 0, time.perf_counter()
    batches = epoch_batches(len(data), args.batch_size, rank, world_size, args.seed, epoch)
    steps_per_epoch = len(batches)
    for i, index in enumerate(batches):
        x, y = split_xy(data[index])
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        batch_loss = loss.item()
        loss_sum += torch.tensor([batch_loss * len(index), len(index)], dtype=torch.float64)
        window_loss += batch_loss
        window_samples += len(index)
        if (i + 1) % args.log_every_steps == 0:
            window_s = time.perf_counter() - window_start
            records.append(
                {
                    "step": epoch * steps_per_epoch + i + 1,
                    "time": time.time(),  # what MlflowLogger stamps its metrics with
                    "train_loss": window_loss / args.log_every_steps,
                    "samples_per_s": window_samples * world_size / window_s,
                }
            )
            window_loss, window_samples, window_start = 0.0, 0, time.perf_counter()
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    return float(loss_sum[1])


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(1)  # torchrun sets OMP_NUM_THREADS=1 too; be explicit
    dist.init_process_group("gloo")  # env:// rendezvous from torchrun
    rank = dist.get_rank()
    train = _train_windows(args.source, args.holdout_fraction)
    config = CharLSTMConfig(
        hidden_size=args.hidden_size, num_layers=args.num_layers, dropout=args.dropout
    )
    torch.manual_seed(args.seed)  # as train_rank: same weights on every rank,
    model = DistributedDataParallel(CharLSTM(config))
    torch.manual_seed(args.seed + 7919 * rank)  # independent dropout masks
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    first_step: list[float] = []

    def stamp_first_step(*_: object) -> None:
        if not first_step:
            first_step.append(time.time())

    optimizer.register_step_post_hook(stamp_first_step)
    records: list[dict[str, float]] = []
    epoch_rates = []
    for epoch in range(args.epochs):
        started = time.perf_counter()
        num_samples = _epoch(model, optimizer, train, args, epoch, records)
        epoch_rates.append(num_samples / (time.perf_counter() - started))
    if rank == 0:
        launch = os.environ.get("BENCH_LAUNCH_TS")
        report = {
            "launch_ts": float(launch) if launch else None,
            "first_step_ts": first_step[0],
            "world_size": dist.get_world_size(),
            "num_train_samples": len(train),
            "records": records,
            "epoch_samples_per_s": epoch_rates,
        }
        print("BENCH_RESULT " + json.dumps(report), flush=True)
    # Both ranks leave together: a rank whose peer already tore gloo down can abort on exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
