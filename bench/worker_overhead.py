"""What a Dask worker costs a DDP rank: each of the worker's periodic jobs switched off in turn.

    PYTHONPATH=. .venv/bin/python -m bench.worker_overhead [--quick] [--rounds N]

Two ranks train the launch benchmark's step (bench/torchrun_step.py: LSTM 4x128, batch 512
per rank, gloo on 127.0.0.1, one torch thread) for a fixed number of steps, in two places:
- bare: two plain processes started once, each rank on its main thread with nothing else in
  the process (what torchrun's ranks are);
- dask: the two workers of one LocalCluster (worker processes with nannies, the scheduler in
  this process, as a flow has them), each rank in its worker's task thread as ddpflow's
  launcher runs it, while the worker's event loop runs its periodic jobs beside it.
The cluster starts with Dask's defaults for every job under test (the sampling profiler off,
as ddpflow had it before). A variant switches jobs off (or the profiler on) in the running
workers and nannies (`client.run`), measures, and switches them back, so every variant uses
the same processes. Each round runs every variant once, in a shuffled order; a variant's
figure is the median over rounds of its rate divided by the bare rate of the same round.
Round 0 is warm-up and is dropped from the rates (not from the CPU shares, which vary little).
Beside each rate it records the CPU time, in % of one core over the measurement, of each
worker's event-loop thread and of this process (the scheduler and the nannies): what the
variant costs whatever the load, where the rates on a shared machine swing by tens of %.
"""

from __future__ import annotations

import datetime
import functools
import json
import multiprocessing
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import dask
import distributed
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench.common import command_line, machine, median
from bench.worker_jobs import VARIANTS, overhead_cpu_s, variant_switch
from ddpflow.distributed.context import find_free_port

WORLD = 2
BATCH = 512
# Its entry of latest.json, "worker_overhead" (merged: the file's other entries are kept).
RESULTS = Path(__file__).with_name("results") / "latest.json"


def _config() -> dict[str, Any]:
    """The cluster's config: ddpflow's worker settings, with Dask's defaults for each job."""
    return {
        "distributed.worker.daemon": False,
        "distributed.worker.profile.enabled": False,
        "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
        "distributed.admin.tick.interval": "20ms",
        "distributed.admin.system-monitor.interval": "500ms",
        "distributed.worker.memory.monitor-interval": "100ms",
        "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "warning",
    }


@functools.cache
def _windows(num_names: int) -> torch.Tensor:
    from bench.torchrun_step import _train_windows
    from ddpflow.workloads.charlm.corpus import load_names

    names, _ = load_names()
    path = Path(tempfile.gettempdir()) / f"ddpflow-bench-overhead-{num_names}.json"
    if not path.exists():
        path.write_text(json.dumps(names[:num_names]))
    return _train_windows(str(path), 0.1)


def rank_rate(rank: int, port: int, steps: int, num_names: int) -> float:
    """Join a 2-rank gloo group, train `steps` steps after 3 warm-up ones; global samples/s."""
    from ddpflow.training.batching import epoch_batches
    from ddpflow.workloads.charlm.config import CharLSTMConfig
    from ddpflow.workloads.charlm.formatting import split_xy
    from ddpflow.workloads.charlm.model import CharLSTM

    torch.set_num_threads(1)
    data = _windows(num_names)
    store = dist.TCPStore(
        "127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(CharLSTM(CharLSTMConfig()))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
        batches = epoch_batches(len(data), BATCH, rank, WORLD, 0, 0)
        started = 0.0
        for i in range(steps + 3):
            if i == 3:
                dist.barrier()
                started = time.perf_counter()
            x, y = split_xy(data[batches[i % len(batches)]])
            optimizer.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            loss.item()
        seconds = time.perf_counter() - started
        dist.barrier()
        return steps * BATCH * WORLD / seconds
    finally:
        dist.destroy_process_group()


def _bare_rank(rank: int, jobs: Any, answers: Any) -> None:
    while (job := jobs.get()) is not None:
        answers.put(rank_rate(rank, *job))


def measure(rounds: int, steps: int, num_names: int, variants: list[str]) -> dict[str, list[float]]:
    from ddpflow.cluster.forkserver import fork_workers_from_a_preloaded_server

    ratios: dict[str, list[float]] = {v: [] for v in variants}
    rates: dict[str, list[float]] = {v: [] for v in ["bare", *variants]}
    cpu: dict[str, dict[str, list[float]]] = {v: {"loop": [], "cluster": []} for v in variants}
    ctx = multiprocessing.get_context("spawn")
    jobs, answers = [ctx.Queue() for _ in range(WORLD)], ctx.Queue()
    bare = [ctx.Process(target=_bare_rank, args=(r, jobs[r], answers)) for r in range(WORLD)]
    for process in bare:
        process.start()
    dask.config.set(_config())
    fork_workers_from_a_preloaded_server()
    cluster = distributed.LocalCluster(
        n_workers=WORLD, threads_per_worker=1, host="127.0.0.1", dashboard_address=":0"
    )
    try:
        with distributed.Client(cluster) as client:
            client.wait_for_workers(WORLD)
            workers = sorted(client.scheduler_info()["workers"])

            def in_dask(variant: str) -> float:
                switch = variant_switch(client, variant) if variant != "dask defaults" else None
                if switch:
                    switch(True)
                try:
                    port = find_free_port()
                    before, started = overhead_cpu_s(client), time.monotonic()
                    futures = [
                        client.submit(rank_rate, r, port, steps, num_names, workers=[w], pure=False)
                        for r, w in enumerate(workers)
                    ]
                    rate = client.gather(futures)[0]
                    after, wall = overhead_cpu_s(client), time.monotonic() - started
                    # % of one core over the measurement: per worker loop, and this process
                    # (each nanny answers for it: the sum counts it WORLD times).
                    for where, a, b in zip(("loop", "cluster"), after, before, strict=True):
                        cpu[variant][where].append(100 * (a - b) / wall / WORLD)
                    return rate
                finally:
                    if switch:
                        switch(False)

            def in_bare() -> float:
                port = find_free_port()
                for queue in jobs:
                    queue.put((port, steps, num_names))
                return [answers.get(timeout=300) for _ in range(WORLD)][0]

            for number in range(rounds + 1):
                order = ["bare", *variants]
                random.Random(number).shuffle(order)
                got = {v: in_bare() if v == "bare" else in_dask(v) for v in order}
                load = os.getloadavg()[0]
                print(f"round {number} (load {load:.2f}): " + ", ".join(
                    f"{v} {r:,.0f}" for v, r in got.items()), flush=True)  # fmt: skip
                if number == 0:
                    continue
                for variant, rate in got.items():
                    rates[variant].append(rate)
                    if variant != "bare":
                        ratios[variant].append(rate / got["bare"])
    finally:
        cluster.close()
        for queue in jobs:
            queue.put(None)
        for process in bare:
            process.join(timeout=30)
    return {"rates": rates, "ratios": ratios, "cpu_percent": cpu}  # type: ignore[dict-item]


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.worker_overhead", __doc__, quick="4 rounds of 20 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (4 if args.quick else 8)
    steps = args.steps or (20 if args.quick else 40)
    load_before = os.getloadavg()
    started = time.time()
    found = measure(rounds, steps, 10_000, args.variants)
    summary = {
        v: {
            "median_ratio_to_bare": median(r),
            "median_samples_per_s": median(found["rates"][v]),
            "worker_loop_cpu_percent": median(found["cpu_percent"][v]["loop"]),
            "cluster_process_cpu_percent": median(found["cpu_percent"][v]["cluster"]),
        }
        for v, r in found["ratios"].items()
    }
    summary["bare"] = {"median_samples_per_s": median(found["rates"]["bare"])}
    print(f"\n{'variant':30} {'samples/s':>10} {'/ bare':>7} {'loop %':>7} {'cluster %':>9}")
    for variant, row in summary.items():
        cells = [f"{variant:30} {row['median_samples_per_s']:>10,.0f}"]
        if "median_ratio_to_bare" in row:
            cells.append(f"{row['median_ratio_to_bare']:7.3f}")
            cells += [
                f"{row[k]:7.2f}" for k in ("worker_loop_cpu_percent", "cluster_process_cpu_percent")
            ]
        print(" ".join(cells))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "rounds": rounds,
        "steps": steps,
        "summary": summary,
        **found,
    }
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["worker_overhead"] = report
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written to {RESULTS} (worker_overhead)")


if __name__ == "__main__":
    main()
