"""Training input path: ddpflow's training step vs pure compute vs the tutorial's DataLoader path.

    .venv/bin/python -m bench.input_path [--quick] [--world-sizes 1 2]

Each world size runs as that many processes (torch.multiprocessing spawn, gloo on
127.0.0.1, one torch thread each, as ddpflow's ranks run) with the tutorial's model size
(LSTM 4 x 128, dropout 0.1), batch 512 per rank and the same names. Per round, each path
trains `steps` steps, in this order:

(a) ddpflow: `fit_loop` (training/loop.py) for one epoch (NullLogger, no checkpoint): index
    slicing `windows[idx]` + `split_xy` + CharLSTM (one-hot inside forward) under DDP + Adam.
    Its figure is fit's own EpochStats.samples_per_s (training time only, eval excluded).
(b) pure compute: the same DDP model and optimizer over (x, y) index batches made before the
    timer starts: forward/backward/Adam and nothing else.
(c) seed, the tutorial's code in bench/seed_reference.py: `OurDataset` (per-item one-hot
    float tensors) + DistributedSampler + DataLoader (per-item __getitem__ and default
    collate), the tutorial's Model under DDP, CrossEntropyLoss.

Round 0 is warm-up and is dropped. Rounds are short and many so that the three paths see the
same load (other processes on a shared 2-core machine swing a rate by 10-20 % within a
minute): each ratio is the median over rounds of that round's paired ratio, and each rate
printed is the median over rounds. Rates are global samples/s (all ranks).

On a CPU the LSTM step (~100 ms) hides most of what the input path costs, so the batch making
alone is timed too, in this process: ddpflow's `split_xy(windows[idx])` plus the one-hot of
x (which its model does in forward, and the tutorial's batches already hold) vs one batch of
the tutorial's `DataLoader(OurDataset, batch_size, shuffle=True)`. That is the cost a fast
accelerator step would expose.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from bench.common import BENCH_THREADS, Result, command_line, median, print_results
from bench.seed_reference import Model, OurDataset
from ddpflow.distributed.context import RankContext, RankSpec, find_free_port, process_group
from ddpflow.tracking.loggers import NullLogger
from ddpflow.training.batching import epoch_batches
from ddpflow.training.loop import FitPlan, fit_loop
from ddpflow.training.samples import TensorSamples
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.corpus import load_names
from ddpflow.workloads.charlm.formatting import format_names, one_hot, split_xy
from ddpflow.workloads.charlm.model import CharLSTM

Batch = tuple[torch.Tensor, torch.Tensor]
Optimizer = torch.optim.Optimizer
PURE_TARGET = 0.95
LR = 0.005


@dataclass(frozen=True)
class InputPathConfig:
    world_size: int
    batch_size: int = 512
    steps: int = 25
    rounds: int = 3  # timed rounds, after one warm-up round


def names_for(num_samples: int) -> list[str]:
    """The first names of the corpus that give at least `num_samples` windows."""
    names, _ = load_names()
    total = 0
    for count, name in enumerate(names, start=1):
        total += len(name) + 1
        if total >= num_samples:
            return names[:count]
    raise ValueError(f"the corpus has only {total} samples, {num_samples} needed")


def _ddpflow_round(
    model: nn.Module,
    optimizer: Optimizer,
    windows: torch.Tensor,
    ctx: RankContext,
    cfg: InputPathConfig,
    epoch: int,
) -> float:
    plan = FitPlan(epochs=epoch + 1, batch_size=cfg.batch_size, seed=0, start_epoch=epoch)
    stats = fit_loop(
        model=model,
        optimizer=optimizer,
        train=TensorSamples(windows, split_xy),
        val=TensorSamples(windows[:64], split_xy),
        ctx=ctx,
        logger=NullLogger(),
        save_checkpoint=_no_save,
        plan=plan,
    )
    return stats[-1].samples_per_s


def _no_save(epoch: int) -> None:
    pass


def _pure_round(
    model: nn.Module, optimizer: Optimizer, batches: list[Batch], cfg: InputPathConfig
) -> float:
    started = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
    return len(batches) * cfg.batch_size * cfg.world_size / (time.perf_counter() - started)


def _seed_round(
    model: nn.Module,
    optimizer: Optimizer,
    dataset: OurDataset,
    sampler: DistributedSampler,
    loader: DataLoader,
    epoch: int,
) -> float:
    """The body of the tutorial's train() epoch loop, minus its per-batch Dask log line."""
    criterion = nn.CrossEntropyLoss()
    started = time.perf_counter()
    sampler.set_epoch(epoch)
    dataset.permute()
    for batch_x, batch_y in loader:
        optimizer.zero_grad()
        batch_y_pred = model(batch_x)
        loss = criterion(batch_y_pred.transpose(1, 2), batch_y)
        loss.backward()
        optimizer.step()
    return len(dataset) / (time.perf_counter() - started)


def _seed_dataset(names: list[str], num_samples: int) -> OurDataset:
    dataset = OurDataset(names)
    # Trimmed to the same sample count as (a) and (b), so every path runs the same steps.
    dataset.x, dataset.y = dataset.x[:num_samples], dataset.y[:num_samples]
    dataset.permute()
    return dataset


def _rank(rank: int, cfg: InputPathConfig, port: int, out: str) -> None:
    torch.set_num_threads(BENCH_THREADS)
    spec = RankSpec(rank, cfg.world_size, "127.0.0.1", port, "gloo", 300.0, uuid.uuid4().hex)
    num_samples = cfg.steps * cfg.batch_size * cfg.world_size
    names = names_for(num_samples)
    windows = format_names(names)[:num_samples].contiguous()
    with process_group(spec) as ctx:
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        ours = DistributedDataParallel(CharLSTM(CharLSTMConfig()))
        ours_opt = torch.optim.Adam(ours.parameters(), lr=LR)
        x, y = split_xy(windows[rank :: cfg.world_size])
        batches = list(zip(x.split(cfg.batch_size), y.split(cfg.batch_size), strict=True))
        batches = [(bx.contiguous(), by.contiguous()) for bx, by in batches]
        seed_model = DistributedDataParallel(Model())
        seed_opt = torch.optim.Adam(seed_model.parameters(), lr=LR)
        dataset = _seed_dataset(names, num_samples)
        sampler = DistributedSampler(dataset)  # as the tutorial's train(): the default group
        loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler)
        rates: dict[str, list[float]] = {"ddpflow": [], "pure": [], "seed": []}
        for epoch in range(cfg.rounds + 1):
            rates["ddpflow"].append(_ddpflow_round(ours, ours_opt, windows, ctx, cfg, epoch))
            rates["pure"].append(_pure_round(ours, ours_opt, batches, cfg))
            rates["seed"].append(_seed_round(seed_model, seed_opt, dataset, sampler, loader, epoch))
    if rank == 0:
        Path(out).write_text(json.dumps({k: v[1:] for k, v in rates.items()}))


def measure(cfg: InputPathConfig) -> dict[str, list[float]]:
    """Timed rounds' global samples/s of each path, run by `cfg.world_size` processes."""
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-input-") as tmp:
        out = str(Path(tmp) / "rates.json")
        mp.spawn(_rank, args=(cfg, find_free_port(), out), nprocs=cfg.world_size, join=True)
        return json.loads(Path(out).read_text())


def _results(cfg: InputPathConfig, rates: dict[str, list[float]]) -> list[Result]:
    ours, pure, seed = (median(rates[k]) for k in ("ddpflow", "pure", "seed"))
    vs_pure, vs_seed = (
        median([a / b for a, b in zip(rates["ddpflow"], rates[k], strict=True)])
        for k in ("pure", "seed")
    )
    name = f"input path ({cfg.world_size} rank{'s' if cfg.world_size > 1 else ''})"
    setup = (
        f"batch {cfg.batch_size}/rank, {cfg.rounds} rounds x {cfg.steps} steps per path; "
        "median rate, median of paired ratios"
    )
    return [
        Result(
            name,
            "ddpflow step vs pure compute",
            ours,
            pure,
            "samples/s",
            vs_pure,
            f"ddpflow/pure rate >= {PURE_TARGET:g}",
            vs_pure >= PURE_TARGET,
            setup,
            {"rounds": rates},
        ),
        Result(
            name,
            "ddpflow step vs seed DataLoader",
            ours,
            seed,
            "samples/s",
            vs_seed,
            "ddpflow/seed rate (info)",
            None,
        ),
    ]


def _ddpflow_batches(windows: torch.Tensor, batch_size: int, epoch: int) -> int:
    for index in epoch_batches(len(windows), batch_size, 0, 1, 0, epoch):
        x, y = split_xy(windows[index])
        one_hot(x)
    return len(windows) // batch_size


def _seed_batches(dataset: OurDataset, loader: DataLoader) -> int:
    dataset.permute()
    return sum(1 for _ in loader)


def batch_making(batch_size: int, num_batches: int, repeats: int) -> Result:
    """Milliseconds per batch, best of `repeats` epochs, with no model step at all."""
    torch.set_num_threads(BENCH_THREADS)
    num_samples = batch_size * num_batches
    names = names_for(num_samples)
    windows = format_names(names)[:num_samples].contiguous()
    dataset = _seed_dataset(names, num_samples)  # no process group: the tutorial's 1-process form
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    ours = best_of_ms(lambda e: _ddpflow_batches(windows, batch_size, e), repeats)
    seed = best_of_ms(lambda e: _seed_batches(dataset, loader), repeats)
    return Result(
        "input path (batch making)",
        "ms per batch, no model step",
        ours,
        seed,
        "ms",
        seed / ours,
        "seed/ddpflow time (info)",
        None,
        f"batch {batch_size}, {num_batches} batches per epoch, best of {repeats} epochs; "
        "ddpflow's includes the one-hot its model does in forward",
    )


def best_of_ms(epoch_fn: Callable[[int], int], repeats: int) -> float:
    """Best ms per batch; `epoch_fn(epoch)` makes one epoch's batches and returns how many."""
    best = float("inf")
    for epoch in range(repeats):
        started = time.perf_counter()
        num_batches = epoch_fn(epoch)
        best = min(best, (time.perf_counter() - started) * 1000 / num_batches)
    return best


def run(quick: bool = False, world_sizes: tuple[int, ...] = (1, 2)) -> list[Result]:
    results = []
    for world_size in world_sizes:
        cfg = InputPathConfig(world_size, steps=5 if quick else 6, rounds=6 if quick else 15)
        results += _results(cfg, measure(cfg))
    results.append(batch_making(512, 20 if quick else 60, 3 if quick else 5))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.input_path", __doc__, quick="fewer steps and rounds")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    print_results("training input path", run(args.quick, tuple(args.world_sizes)))


if __name__ == "__main__":
    main()
