"""What growing a running training costs: a third worker joins a 2-rank ddpflow.run().

    PYTHONPATH=. .venv/bin/python -m bench.grow [--quick] [--settle-s S] [--record]

A LocalCluster of 2 worker processes trains an MLP with ddpflow.fit (min_workers=2,
max_workers=3). Once rank 0 has stepped steadily for a while, the cluster is scaled to 3
workers; the grow watch takes the newcomer after `--settle-s`, the group checkpoints at its
next control step and is relaunched on 3 ranks. Rank 0 writes the time and world size of
every step, so from one run:
- grow cost: from the new worker's registration to rank 0's first step at 3 ranks. It
  includes the settle time (chosen) and the watch's look (1 s at most); what is left is the
  stop at the next control step, the checkpoint and the relaunch. The baseline is the cold
  launch of the same training in the same run (ddpflow.run called -> first step at 2 ranks);
  the ratio is (grow cost - settle) / cold launch.
- steady samples/s at 3 ranks against 2, each over its steps after the first 10 (the
  figure of the machine: on 2 cores, 3 ranks share 2 cores, so more ranks are not faster).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import distributed
import torch
from torch import nn

import ddpflow
from bench.common import Result, command_line, load_average, print_results, record_entry
from ddpflow.cluster.build import local_cluster
from ddpflow.distributed.supervisor.watch import cluster_workers

FEATURES, HIDDEN, CLASSES = 64, 1024, 10
BATCH_SIZE = 64  # per rank
SKIP_STEPS = 10  # the first steps of an attempt: warm-up, not the steady rate


class _Timed:
    """The training samples; on rank 0, each batch taken appends (time, world size)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, log: Path | None, world_size: int):
        self.x, self.y, self.log, self.world_size = x, y, log, world_size

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.log is not None:
            with self.log.open("a") as file:
                file.write(json.dumps([time.time(), self.world_size]) + "\n")
        return self.x[index], self.y[index]


def train(ctx: ddpflow.TrainContext, log: str, samples: int, epochs: int) -> int:
    """An MLP classifier on synthetic data, a control step every 5 steps."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (samples,), generator=generator)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )  # fmt: skip
    data = _Timed(x, y, Path(log) if ctx.is_main else None, ctx.world_size)
    ddpflow.fit(
        ctx,
        model=ctx.wrap(net),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        train=data,
        val=ddpflow.TensorPairs(x[:512], y[:512]),
        epochs=epochs,
        batch_size=BATCH_SIZE,
        hooks=ddpflow.FitHooks(loss=nn.functional.cross_entropy),
        log_every_steps=5,
    )
    return ctx.world_size


def _steps(log: Path) -> list[tuple[float, int]]:
    if not log.exists():
        return []
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


def _rate(steps: list[tuple[float, int]], world_size: int) -> float:
    """Samples/s over the steps at `world_size` after its first SKIP_STEPS."""
    times = [t for t, w in steps if w == world_size][SKIP_STEPS:]
    if len(times) < 2:
        return float("nan")
    return (len(times) - 1) * BATCH_SIZE * world_size / (times[-1] - times[0])


def measure(settle_s: float, samples: int, epochs: int, steady_steps: int) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as folder,
        local_cluster(2) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        log = Path(folder) / "steps.jsonl"
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["world_size"] = ddpflow.run(
                    client, train, str(log), samples, epochs,
                    min_workers=2, max_workers=3, settle_s=settle_s,
                    checkpoint_dir=str(Path(folder) / "checkpoints"),
                    on_resize=lambda r: outcome.setdefault("resizes", []).append(r),
                )  # fmt: skip
            except BaseException as error:  # noqa: BLE001 - reported below
                outcome["error"] = error

        called = time.time()
        trainer = threading.Thread(target=run)
        trainer.start()
        while len(_steps(log)) < steady_steps and trainer.is_alive():
            time.sleep(0.1)
        cluster.scale(3)
        while len(cluster_workers(client)) < 3 and trainer.is_alive():
            time.sleep(0.05)
        arrived = time.time()
        trainer.join()
        steps = _steps(log)  # before the folder goes
    if "error" in outcome:
        raise outcome["error"]
    first = {w: next((t for t, s in steps if s == w), float("nan")) for w in (2, 3)}
    if outcome.get("world_size") != 3:
        raise RuntimeError(
            f"the training finished at {outcome.get('world_size')} ranks before it grew: "
            "raise the epochs"
        )
    return {
        "cold_launch_s": first[2] - called,
        "grow_s": first[3] - arrived,
        "rate_2": _rate(steps, 2),
        "rate_3": _rate(steps, 3),
        "steps": len(steps),
    }


def results(found: dict[str, Any], settle_s: float) -> list[Result]:
    relaunch = found["grow_s"] - settle_s
    return [
        Result(
            "grow",
            "worker arrives -> first step at 3 ranks",
            found["grow_s"],
            found["cold_launch_s"],
            "s",
            relaunch / found["cold_launch_s"],
            "(grow - settle) / cold launch (info)",
            None,
            f"settle_s={settle_s:g} included; beyond it {relaunch:.2f} s: the control step "
            "(every 5 steps), the checkpoint and the relaunch. Baseline: ddpflow.run called "
            "-> first step at 2 ranks, same run",
        ),
        Result(
            "grow",
            "steady samples/s, 3 ranks vs 2",
            found["rate_3"],
            found["rate_2"],
            "samples/s",
            found["rate_3"] / found["rate_2"],
            "3 ranks / 2 ranks (info)",
            None,
            f"per-rank batch {BATCH_SIZE}; each size's steps after its first {SKIP_STEPS}; "
            "3 ranks share this machine's cores",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = command_line(
        "bench.grow", __doc__, quick="a smaller dataset, settle 3 s", record="grow"
    )
    parser.add_argument("--settle-s", type=float, default=None, help="default 10 (quick 3)")
    args = parser.parse_args(argv)
    settle_s = args.settle_s if args.settle_s is not None else (3.0 if args.quick else 10.0)
    samples, epochs, steady = (32_768, 6, 60) if args.quick else (65_536, 6, 200)
    load_before = load_average()
    found = measure(settle_s, samples, epochs, steady)
    rows = results(found, settle_s)
    print_results("growing a running training from 2 to 3 ranks", rows)
    if args.record:
        command = "python -m bench.grow" + (" --quick" if args.quick else "")
        record_entry("grow", command, load_before, rows, measured=found)


if __name__ == "__main__":
    main()
