"""Each speed setting this machine runs, against fp32 measured in the same run, as ratios.

    .venv/bin/python -m bench.speed_settings [--quick] [--compile]

The same small training through `fit_loop` (ddpflow.training.loop) itself (one process,
one thread, no process group, a null logger, no checkpoint, validation replaced by a
constant) with each setting of `ddpflow.training.speed.device`, and fp32 with torch's
default Adam instead of the fused one the workloads build (`fp32+unfused_adam`): the
ResNet-18 image workload (uint8 images, random labels) and the pet-name LSTM (4x128, batch
512). Each round trains one short epoch per setting, in turn; round 0 is warm-up and
dropped. The figure is the median over rounds of the paired ratio setting/fp32 of fit's
own samples/s, so load that changes during the run hits both sides of each ratio. A
setting the machine cannot run (pinning without CUDA, a precision its kernels lack) is
recorded with the reason instead of a figure.

Writes the `speed_settings` entry of bench/results/latest.json (merged: the file's other
entries are kept), keyed by "<workload>/<setting>".
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import BENCH_THREADS, command_line, load_average, machine, median
from ddpflow.distributed.context import RankContext
from ddpflow.tracking.loggers import NullLogger
from ddpflow.training.loop import FitHooks, FitPlan, fit_loop
from ddpflow.training.samples import TensorSamples
from ddpflow.training.speed.device import resolve_speed
from ddpflow.training.speed.settings import SpeedError, SpeedSettings
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.formatting import split_xy
from ddpflow.workloads.charlm.model import CharLSTM
from ddpflow.workloads.vision.model import build_resnet

RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"
CPU = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="none")
# fp32 with torch's default Adam instead of the fused one the workloads build
# (TrainSpeed.fused_optimizer): what fusing the optimizer's step is worth.
UNFUSED = "fp32+unfused_adam"


def _settings(compile_too: bool) -> dict[str, dict[str, SpeedSettings]]:
    images = {
        "fp32": SpeedSettings("fp32"),
        "channels_last": SpeedSettings("fp32", channels_last=True),
        "bf16": SpeedSettings("bf16"),
        "bf16+channels_last": SpeedSettings("bf16", channels_last=True),
        "pin_memory": SpeedSettings("fp32", pin_memory=True),
        UNFUSED: SpeedSettings("fp32"),
    }
    charlm = {
        "fp32": SpeedSettings("fp32"),
        "bf16": SpeedSettings("bf16"),
        UNFUSED: SpeedSettings("fp32"),
    }
    if compile_too:
        images["compile"] = SpeedSettings("fp32", compile=True)
        charlm["compile"] = SpeedSettings("fp32", compile=True)
    return {"images": images, "charlm": charlm}


def _workload(name: str, quick: bool) -> tuple[Callable[[], nn.Module], Any, Any, int, tuple]:
    """(model factory, train data, to_batch, batch size, a probe batch) of one workload."""
    gen = torch.Generator().manual_seed(0)
    if name == "images":
        batch, size = (8, 32) if quick else (16, 32)
        images = torch.randint(0, 256, (batch * 3, 3, size, size), dtype=torch.uint8, generator=gen)
        labels = torch.randint(0, 10, (len(images),), generator=gen)
        data = torch.arange(len(images))
        return (
            lambda: build_resnet("resnet18", 10),
            data,
            lambda index: (images[index], labels[index]),
            batch,
            (images[:2], labels[:2]),
        )
    batch = 512
    windows = torch.randint(0, 31, (batch * (3 if quick else 6), 9), generator=gen)
    return lambda: CharLSTM(CharLSTMConfig()), windows, split_xy, batch, split_xy(windows[:2])


def _prepare(
    name: str, settings: SpeedSettings, factory, probe, images: bool
) -> tuple[Any, Any] | str:
    """(model, optimizer, speed), or why this setting cannot run here."""
    try:
        speed = resolve_speed(settings, CPU.device, images=images)
        torch.manual_seed(0)
        model = speed.apply_to_model(factory())
        speed.check_runs(model, *probe)
    except SpeedError as error:
        return str(error)
    if speed.notes:
        return "; ".join(speed.notes)
    speed.compile_model(model)
    fused = speed.fused_optimizer and name != UNFUSED
    return model, torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None), speed


def _epoch_rate(prepared, data, to_batch, batch: int) -> float:
    model, optimizer, speed = prepared
    (stats,) = fit_loop(
        model=model,
        optimizer=optimizer,
        train=TensorSamples(data, to_batch),
        val=TensorSamples(data[:1], to_batch),
        ctx=CPU,
        logger=NullLogger(),
        save_checkpoint=lambda epoch: None,
        plan=FitPlan(epochs=1, batch_size=batch, seed=0, log_every_steps=10**6),
        hooks=FitHooks(evaluate=lambda m: {"val_loss": 0.0}, speed=speed),
    )
    return stats.samples_per_s


def run(quick: bool, compile_too: bool = False) -> dict[str, Any]:
    rounds = 3 if quick else 6
    found: dict[str, Any] = {}
    for workload, settings in _settings(compile_too).items():
        factory, data, to_batch, batch, probe = _workload(workload, quick)
        images = workload == "images"
        prepared = {n: _prepare(n, s, factory, probe, images) for n, s in settings.items()}
        rates: dict[str, list[float]] = {
            n: [] for n, p in prepared.items() if not isinstance(p, str)
        }
        for round_ in range(rounds + 1):  # round 0: warm-up (and compilation), dropped
            for name in rates:
                rate = _epoch_rate(prepared[name], data, to_batch, batch)
                if round_:
                    rates[name].append(rate)
            shown = ", ".join(f"{n} {r[-1]:.1f}" for n, r in rates.items() if r and round_)
            print(f"{workload} round {round_}: {shown + ' samples/s' if shown else 'warm-up'}")
        for name, p in prepared.items():
            key = f"{workload}/{name}"
            if isinstance(p, str):
                found[key] = {"ratio_to_fp32": None, "skipped": p}
                continue
            ratios = [r / b for r, b in zip(rates[name], rates["fp32"], strict=True)]
            found[key] = {
                "samples_per_s": round(median(rates[name]), 2),
                "fp32_samples_per_s": round(median(rates["fp32"]), 2),
                "ratio_to_fp32": round(median(ratios), 3),
                "rounds": rounds,
                "batch_size": batch,
            }
    return found


def merge_into(path: Path, entry: dict[str, Any]) -> None:
    """Set the `speed_settings` entry of the results file, keeping every other entry."""
    report = json.loads(path.read_text()) if path.exists() else {}
    report["speed_settings"] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.speed_settings", __doc__, quick="smaller batches, 3 rounds")
    parser.add_argument("--compile", action="store_true", help="also torch.compile (slow start)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(BENCH_THREADS)
    before, started = machine(), time.perf_counter()
    results = run(args.quick, args.compile)
    entry = {
        "mode": "quick" if args.quick else "full",
        "machine": before,
        "load_average_after": [round(v, 2) for v in load_average()],
        "seconds": round(time.perf_counter() - started, 1),
        "results": results,
    }
    print(json.dumps(results, indent=1))
    merge_into(args.output, entry)
    print(f"written to {args.output} (key speed_settings)")


if __name__ == "__main__":
    main()
