"""Formatting: the tutorial's format_training_data vs ddpflow's format_names on the shipped corpus.

The tutorial's code is kept verbatim in bench/seed_reference.py ("seed" in the labels).

    .venv/bin/python -m bench.formatting [--quick]

Both functions get the same cleaned names (`load_names()`, 50,000 names). Time: best of N
wall-clock runs of each call, nothing else inside the timer. Bytes: what each keeps for the
training set: the tutorial's one-hot float32 x plus int64 y tensors, ddpflow's uint8 windows
(x and y are views of it; one-hot happens per batch).
"""

from __future__ import annotations

import torch

from bench.common import Result, best_of, command_line, print_results
from bench.seed_reference import format_training_data
from ddpflow.workloads.charlm.corpus import load_names
from ddpflow.workloads.charlm.formatting import format_names

SPEED_TARGET = 50.0
BYTES_TARGET = 30.0


def _same_windows(windows: torch.Tensor, seed_x: torch.Tensor, seed_y: torch.Tensor) -> bool:
    """Guard: a faster function that computed something else would prove nothing."""
    return torch.equal(windows[:, 1:].long(), seed_y) and torch.equal(
        windows[:, :-1].long(), seed_x.argmax(dim=-1)
    )


def run(quick: bool = False) -> list[Result]:
    names, _ = load_names()
    seed_repeats, ours_repeats = (1, 5) if quick else (3, 20)
    seed_s, (seed_x, seed_y) = best_of(lambda: format_training_data(names), seed_repeats)
    ours_s, windows = best_of(lambda: format_names(names), ours_repeats)
    if not _same_windows(windows, seed_x, seed_y):
        raise SystemExit("format_names and the tutorial's format_training_data disagree")
    seed_bytes = seed_x.nbytes + seed_y.nbytes
    ours_bytes = windows.nbytes
    speedup = seed_s / ours_s
    share = ours_bytes / seed_bytes
    samples = f"{len(names):,} names, {len(windows):,} samples"
    return [
        Result(
            "formatting",
            "time (best of N)",
            ours_s * 1000,
            seed_s * 1000,
            "ms",
            speedup,
            f"seed/ddpflow time >= {SPEED_TARGET:g}",
            speedup >= SPEED_TARGET,
            f"{samples}; best of {ours_repeats} (ddpflow) / {seed_repeats} (seed) runs",
        ),
        Result(
            "formatting",
            "bytes of training set",
            ours_bytes / 2**20,
            seed_bytes / 2**20,
            "MiB",
            share,
            f"ddpflow/seed bytes <= 1/{BYTES_TARGET:g} = {1 / BYTES_TARGET:.3f}",
            share <= 1 / BYTES_TARGET,
            f"{ours_bytes / len(windows):.0f} vs {seed_bytes / len(windows):.0f} bytes/sample",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.formatting", __doc__, quick="fewer repeats")
    args = parser.parse_args(argv)
    print_results("formatting", run(args.quick))


if __name__ == "__main__":
    main()
