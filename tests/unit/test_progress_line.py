"""Rank 0's progress events during fit(): lines for the flow's log (one per epoch, and within
a long epoch one every 30 s) and step counts for the progress artifact (every 2 s at most,
and at each epoch's end), on the one progress channel. fit() runs for real on one rank; only
its clock is fake (a step "takes" N s), so the rules are checked without waiting."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.distributed.context import RankContext
from ddpflow.distributed.progress import Progress
from ddpflow.tracking.loggers import NullLogger
from ddpflow.training import fit_progress
from ddpflow.training.loop import FitPlan, fit_loop
from ddpflow.training.samples import TensorSamples

STEPS = 12  # per epoch: 48 samples in batches of 4 on one rank


class Reporting(RankContext):
    """A single rank whose progress events are kept (in a Dask worker they go to its
    launch's topic)."""

    events: list[Progress]

    def send(self, progress: Progress) -> None:
        self.events.append(progress)


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x, targets=None):
        logits = self.layer(x)
        return logits, F.cross_entropy(logits, targets)


def run_fit(monkeypatch: pytest.MonkeyPatch, seconds_per_step: float) -> list[Progress]:
    clock = SimpleNamespace(now=0.0)
    # Only the progress clock is faked; perf_counter (epoch times) stays real.
    fake_time = SimpleNamespace(monotonic=lambda: clock.now, perf_counter=time.perf_counter)
    monkeypatch.setattr(fit_progress, "time", fake_time)
    torch.manual_seed(0)
    data = torch.randn(48, 2)

    def to_batch(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        clock.now += seconds_per_step  # one batch per training step
        return data[index], (data[index, 0] > 0).long()

    ctx = Reporting(rank=0, world_size=1, device=torch.device("cpu"), backend="none")
    object.__setattr__(ctx, "events", [])  # a frozen dataclass
    model = Linear()
    fit_loop(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train=TensorSamples(torch.arange(48), to_batch),
        val=TensorSamples(torch.arange(4), to_batch),
        ctx=ctx,
        logger=NullLogger(),
        save_checkpoint=lambda epoch: None,
        plan=FitPlan(epochs=2, batch_size=4, seed=0, log_every_steps=1, eval_batch_size=4),
    )
    return ctx.events


def lines_of(events: list[Progress]) -> list[str]:
    return [event.line for event in events if event.line is not None]


# docs/charlm.md "What make demo does" (train): a line per epoch, and within a long epoch
# one every 30 s.
def test_a_long_epoch_reports_every_30_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = lines_of(run_fit(monkeypatch, seconds_per_step=7))
    # 7 s a step: 35 s after the start (step 5), then 35 s later (step 10); each epoch's
    # line restarts the wait.
    steps = [line.split(": step ")[1].split(" ")[0] for line in lines if ": step " in line]
    assert steps == ["5/12", "10/12", "5/12", "10/12"], lines
    assert [line.split(" done")[0] for line in lines if " done:" in line] == [
        "epoch 1/2",
        "epoch 2/2",
    ]
    assert "epoch 1/2: step 5/12 (42 %), train loss " in lines[0], lines


def test_a_short_epoch_reports_only_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = lines_of(run_fit(monkeypatch, seconds_per_step=2))  # 24 s per epoch: under 30 s
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2 done", "epoch 2/2 done"], lines


# docs/inspecting.md "Progress": the artifact follows rank 0's steps, every 2 s at most.
def test_step_counts_go_every_2_seconds_and_at_each_epoch_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = run_fit(monkeypatch, seconds_per_step=0.75)  # 9 s per epoch of 12 steps
    steps = [(event.step, event.val_loss is not None) for event in events if event.has_steps]
    # The first step at once, then one every 2 s of 0.75-s steps (each third step); the
    # epoch's end always, with its validation loss, and the wait starts afresh after it.
    assert steps == [
        (1, False), (4, False), (7, False), (10, False), (12, True),
        (15, False), (18, False), (21, False), (24, False), (24, True),
    ], steps  # fmt: skip
    assert all(e.total_steps == 24 and e.epochs == 2 for e in events if e.has_steps)
    ends = [e for e in events if e.val_loss is not None]
    # The epoch end's line and its step counts are one event: both consumers see it.
    assert [e.line.split(":")[0] for e in ends if e.line] == ["epoch 1/2 done", "epoch 2/2 done"]
    assert [e.epoch for e in ends] == [1, 2]


class Recording(NullLogger):
    """Remembers the order of its calls, and of the checkpoints beside them."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def log_metrics(self, metrics, step: int) -> None:
        if "val_loss" in metrics:
            self.events.append(f"val_loss {step}")

    def flush(self, timeout_s: float) -> bool:
        self.events.append("flush")
        return True


# docs/fault-tolerance.md: each epoch's metrics are flushed to MLflow before its checkpoint.
def test_each_checkpoint_comes_after_its_epochs_metrics_are_flushed() -> None:
    torch.manual_seed(0)
    data = torch.randn(16, 2)
    events: list[str] = []
    ctx = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="none")
    model = Linear()
    to_batch = lambda index: (data[index], (data[index, 0] > 0).long())  # noqa: E731
    fit_loop(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train=TensorSamples(torch.arange(16), to_batch),
        val=TensorSamples(torch.arange(4), to_batch),
        ctx=ctx,
        logger=Recording(events),
        save_checkpoint=lambda epoch: events.append(f"checkpoint {epoch}"),
        plan=FitPlan(epochs=2, batch_size=4, seed=0, log_every_steps=1, eval_batch_size=4),
    )
    expected = ["val_loss 1", "flush", "checkpoint 1", "val_loss 2", "flush", "checkpoint 2"]
    assert events == expected
