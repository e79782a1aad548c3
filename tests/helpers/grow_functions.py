"""The training the elastic-grow tests run through ddpflow.run(), in a module of its own so
the Dask worker processes import it by name: ddpflow.fit on a small regression, with every
rank writing down which samples it trained on at which global step."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpflow

SAMPLES = 600
EPOCHS = 2
BATCH_SIZE = 4  # per rank
GLOBAL_BATCH = 10  # over the group: 5 + 5 on 2 ranks, 4 + 3 + 3 on 3
FEATURES = 8
PAUSE_S = 0.2


class Recorded:
    """Samples that remember the last batch taken (the step's). While the file `pause`
    exists, each batch takes `pause_s` more: the test's workers join and leave meanwhile,
    and it removes the file when the rest may run at full speed. Everything else (a
    streamed split's epoch_order and start_epoch) is the wrapped samples'."""

    def __init__(self, samples: ddpflow.Samples, pause: Path, pause_s: float = PAUSE_S):
        self.samples, self.pause, self.pause_s = samples, pause, pause_s
        self.last: list[int] = []

    def __len__(self) -> int:
        return len(self.samples)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.samples, name)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.last = index.tolist()
        if self.pause.exists():
            time.sleep(self.pause_s)
        return self.samples.batch(index)


class StepsWritten:
    """The launcher's rank context, writing (global step, the step's samples) at each
    step's heartbeat into this attempt's own file."""

    def __init__(self, rank_ctx: Any, data: Recorded, path: Path):
        self._rank_ctx, self._data, self._path = rank_ctx, data, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rank_ctx, name)

    def heartbeat(self, step: int | None = None) -> None:
        self._rank_ctx.heartbeat(step)
        if step is not None:
            with self._path.open("a") as file:
                record = {"t": time.time(), "step": step, "samples": self._data.last}
                file.write(json.dumps(record) + "\n")


class Recording:
    def __init__(self, ctx: ddpflow.TrainContext, rank_ctx: StepsWritten):
        self._ctx, self.rank_context = ctx, rank_ctx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def recording_context(ctx: ddpflow.TrainContext, data: Recorded, log_dir: str) -> Recording:
    """`ctx` for ddpflow.fit, writing each step's samples of `data` into this rank's file of
    this attempt (an attempt's ranks share its launch id)."""
    path = Path(log_dir) / f"{ctx.rank_context.launch_id}-rank{ctx.rank}.jsonl"
    return Recording(ctx, StepsWritten(ctx.rank_context, data, path))


def recorded_fit(
    ctx: ddpflow.TrainContext,
    log_dir: str,
    pause: str,
    global_batch: bool = False,
    pause_s: float = PAUSE_S,
) -> dict[str, Any]:
    """ddpflow.fit over SAMPLES samples for EPOCHS epochs, a control step at every step and
    a step checkpoint every 5: BATCH_SIZE samples per rank a step, or with `global_batch`
    GLOBAL_BATCH per step over the group; while `pause` exists each step takes `pause_s`
    more (sleeping, no CPU: 150 steps on 2 ranks). Returns the world size it finished at
    and the trained weights."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x @ torch.randn(FEATURES, 1, generator=generator)
    data = Recorded(ddpflow.TensorPairs(x, y), Path(pause), pause_s)
    recording = recording_context(ctx, data, log_dir)
    torch.manual_seed(0)
    net = nn.Linear(FEATURES, 1)
    ddpflow.fit(
        recording,  # type: ignore[arg-type]
        model=ctx.wrap(net),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        train=data,
        val=ddpflow.TensorPairs(x[:40], y[:40]),
        epochs=EPOCHS,
        batch_size=GLOBAL_BATCH if global_batch else BATCH_SIZE,
        global_batch=global_batch,
        hooks=ddpflow.FitHooks(loss=nn.functional.mse_loss),
        log_every_steps=1,
        checkpoint_every_steps=5,
    )
    weights = [p.detach().clone() for p in net.parameters()]
    return {"world_size": ctx.world_size, "weights": weights}


def samples_by_epoch(log_dir: str, num_samples: int = SAMPLES) -> list[list[int]]:
    """The samples each epoch trained on, over every attempt and rank, in step order.

    An attempt's steps after the step the next attempt resumed from were trained again
    by that one (a SIGKILL loses them): they are left out. Attempts are ordered by when
    they started; each resumes after its first step - 1.
    """
    attempts: dict[str, dict[int, list[int]]] = {}
    started: dict[str, float] = {}
    for path in Path(log_dir).glob("*.jsonl"):
        launch_id = path.name.split("-rank")[0]
        steps = attempts.setdefault(launch_id, {})
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["samples"])
            started[launch_id] = min(started.get(launch_id, record["t"]), record["t"])
    ordered = [attempts[a] for a in sorted(attempts, key=started.__getitem__)]
    kept: dict[int, list[int]] = {}
    for i, steps in enumerate(ordered):
        until = min(ordered[i + 1]) - 1 if i + 1 < len(ordered) else max(steps)
        kept.update({s: samples for s, samples in steps.items() if s <= until})
    epochs: list[list[int]] = [[]]
    for step in sorted(kept):
        epochs[-1].extend(kept[step])
        if len(epochs[-1]) >= num_samples:
            epochs.append([])
    return [e for e in epochs if e]
