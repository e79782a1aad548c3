"""Checkpoints inside an epoch: fit() runs for real on one rank (a model with dropout, so the
RNG matters), crashes mid-epoch, and a fresh model resumed from the last step checkpoint ends
with bitwise the weights of an uninterrupted run, with every logged step once and equal."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.checkpoint import steps as step_checkpoints
from ddpflow.checkpoint.steps import CheckpointClock, CheckpointSchedule, EpochPosition, step_seed
from ddpflow.checkpoint.store import CheckpointStore, build_state, encode, resume_from
from ddpflow.distributed.context import RankContext
from ddpflow.distributed.supervisor import graceful_stop
from ddpflow.training import loop as training_loop
from ddpflow.training.batching import epoch_batches
from ddpflow.training.loop import FitPlan, fit_loop, resume_line
from ddpflow.training.samples import TensorSamples

STEPS = 12  # per epoch: 48 samples in batches of 4 on one rank
EPOCHS = 2
CTX = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="none")


class Dropping(nn.Module):
    """Dropout before a linear layer: every step draws from torch's RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.drop, self.layer = nn.Dropout(0.5), nn.Linear(4, 2)

    def forward(self, x, targets=None):
        logits = self.layer(self.drop(x))
        return logits, F.cross_entropy(logits, targets)


class Recording:
    """A MetricLogger that keeps (key, step, value); what rank 0 would send to MLflow."""

    def __init__(self) -> None:
        self.points: list[tuple[str, int, float]] = []

    def log_metrics(self, metrics, step: int) -> None:
        self.points += [(k, step, float(v)) for k, v in metrics.items()]

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        pass

    def keep_artifacts(self, artifact_path, names) -> None:
        pass

    def set_tags(self, tags) -> None:
        pass

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(s, v) for k, s, v in self.points if k == key]


class Crash(RuntimeError):
    pass


def train(
    store: CheckpointStore,
    every_steps: int,
    crash_at_batch: int | None = None,
    logger: Recording | None = None,
    log_every_steps: int = 2,
    on_batch: Callable[[], None] | None = None,
) -> tuple[nn.Module, int, EpochPosition | None]:
    """fit() from the store's latest checkpoint (if any); returns the model and where it
    resumed. crash_at_batch: raise when that many batches were taken (a lost worker).
    on_batch: called for each batch read (a step's cost, for rates)."""
    torch.manual_seed(0)
    data = torch.randn(48, 4)
    model = Dropping()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    start_epoch, position, _ = resume_from(store, {"model": model, "optimizer": optimizer})
    taken = 0

    def to_batch(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal taken
        taken += 1
        if taken == crash_at_batch:
            raise Crash
        if on_batch is not None:
            on_batch()
        return data[index], (data[index, 0] > 0).long()

    def save(epoch: int, position: EpochPosition | None = None) -> None:
        state = build_state(model, optimizer, epoch, {})
        if position is not None:
            state["position"] = position.to_dict()
        store.save_encoded(epoch, encode(state), position.step if position else None)

    plan = FitPlan(
        epochs=EPOCHS,
        batch_size=4,
        seed=3,
        start_epoch=start_epoch,
        log_every_steps=log_every_steps,
        eval_batch_size=8,
        checkpoints=CheckpointSchedule(every_steps, every_s=0, control_every=log_every_steps),
        resume_at=position,
    )
    with pytest.raises(Crash) if crash_at_batch else _nothing():
        fit_loop(
            model=model,
            optimizer=optimizer,
            train=TensorSamples(torch.arange(48), to_batch),
            val=TensorSamples(torch.arange(8), to_batch),
            ctx=CTX,
            logger=logger or Recording(),
            save_checkpoint=save,
            plan=plan,
        )
    return model, start_epoch, position


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run"


def dedup(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """What MLflow keeps: a step an earlier attempt logged is not logged again."""
    kept: dict[int, float] = {}
    for step, value in points:
        kept.setdefault(step, value)
    return sorted(kept.items())


# docs/fault-tolerance.md: a crash inside an epoch resumes from the last step checkpoint,
# redoing only the steps since it (here 2, with checkpoint_every_steps = 5), with the
# uninterrupted run's weights.
def test_a_crash_mid_epoch_resumes_from_the_last_step_checkpoint_exactly(tmp_path: Path):
    every = 5
    reference_log = Recording()
    reference, _, _ = train(CheckpointStore(str(tmp_path / "ref"), 100), every, None, reference_log)
    store = CheckpointStore(str(tmp_path / "run"), keep_last=100)
    log = Recording()
    # to_batch's calls: epoch 1's steps, its validation (one batch), then epoch 2's 8th step
    # crashes, after 7 steps of it.
    _, _, _ = train(store, every, crash_at_batch=STEPS + 1 + 8, logger=log)
    assert store.latest_uri() == store.uri_for(1, 5), "the last checkpoint: epoch 2, step 5"
    resumed, start_epoch, position = train(store, every, logger=log)
    assert start_epoch == 1 and position is not None and position.step == 5
    steps_done_before_crash = STEPS + 7
    assert steps_done_before_crash - (STEPS + position.step) < every, "steps redone"
    assert_same(weights(resumed), weights(reference))
    for key in ("train_loss", "epoch_train_loss", "val_loss"):
        assert dedup(log.series(key)) == dedup(reference_log.series(key)), key


# docs/fault-tolerance.md: the weights do not depend on where checkpoints fall.
def test_weights_do_not_depend_on_the_checkpoint_interval(tmp_path: Path):
    without, _, _ = train(CheckpointStore(str(tmp_path / "a"), 100), every_steps=0)
    every_3, _, _ = train(CheckpointStore(str(tmp_path / "b"), 100), every_steps=3)
    assert_same(weights(without), weights(every_3))


def test_a_resume_right_at_each_step_checkpoint_is_exact(tmp_path: Path):
    """Crashes at several steps of epoch 1 after the checkpoint at step 4. Log lines every 3
    steps: a checkpoint inside a logging window carries rank 0's sums of it."""
    ref_log = Recording()
    reference, _, _ = train(CheckpointStore(str(tmp_path / "ref"), 100), 4, None, ref_log, 3)
    for crash in (5, 6, 8, 9):
        store = CheckpointStore(str(tmp_path / f"crash-{crash}"), keep_last=2)
        log = Recording()
        train(store, 4, crash_at_batch=crash, logger=log, log_every_steps=3)
        resumed, start_epoch, position = train(store, 4, logger=log, log_every_steps=3)
        assert (start_epoch, position and position.step) == (0, 4 * ((crash - 1) // 4))
        assert_same(weights(resumed), weights(reference))
        assert dedup(log.series("train_loss")) == dedup(ref_log.series("train_loss")), crash


@pytest.mark.parametrize(("num", "batch", "world"), [(48, 4, 1), (50, 4, 2), (41, 3, 3)])
def test_a_start_offset_gives_the_epochs_remaining_batches(num: int, batch: int, world: int):
    for rank in range(world):
        full = epoch_batches(num, batch, rank, world, seed=7, epoch=2)
        for done in range(len(full)):
            rest = epoch_batches(num, batch, rank, world, 7, 2, start=done * batch * world)
            assert [b.tolist() for b in rest] == [b.tolist() for b in full[done:]]


def test_step_seeds_differ_by_step_rank_and_epoch():
    seeds = {step_seed(0, r, e, s) for r in range(3) for e in range(3) for s in range(100)}
    assert len(seeds) == 900


def test_step_checkpoint_names_sort_in_training_order(tmp_path: Path):
    store = CheckpointStore(str(tmp_path), keep_last=3)
    order = [store.uri_for(1), store.uri_for(1, 5), store.uri_for(1, 40), store.uri_for(2)]
    assert sorted(order) == order
    for epoch, step in ((1, None), (1, 5), (1, 40), (2, None)):
        store.save_encoded(epoch, b"x", step)
    assert store.list_uris() == order[1:], "keep_last counts step checkpoints too"
    assert store.latest_uri() == store.uri_for(2)


@pytest.mark.parametrize(
    ("every_steps", "every_s", "named"),
    [
        (-1, 600, "checkpoint_every_steps=-1"),
        (2.5, 600, "checkpoint_every_steps=2.5"),
        (True, 600, "checkpoint_every_steps=True"),
        (0, -1, "checkpoint_every_s=-1"),
        (0, math.inf, "checkpoint_every_s=inf"),
        (0, math.nan, "checkpoint_every_s=nan"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_value(every_steps, every_s, named: str):
    with pytest.raises(ValueError, match=f"^{named}: pass"):
        CheckpointSchedule(every_steps=every_steps, every_s=every_s)


def test_the_time_trigger_fires_at_control_points_only(monkeypatch: pytest.MonkeyPatch):
    now = [0.0]
    monkeypatch.setattr(step_checkpoints, "time", SimpleNamespace(monotonic=lambda: now[0]))
    clock = CheckpointClock(CheckpointSchedule(0, every_s=60, control_every=10), 1, CTX.device)
    now[0] = 61
    assert clock.check(9) == (False, None), "not a control point"
    assert clock.check(10) == (True, None)
    clock.written()
    now[0] = 100
    assert clock.check(20) == (False, None), "39 s since the last checkpoint"


# docs/fault-tolerance.md: a stop request (SIGTERM) is read at the next control point, which
# checkpoints, and fit() stops there with StopRequested; a resume goes on from that step.
def test_a_stop_request_checkpoints_at_the_next_control_point_and_stops(tmp_path: Path):
    store = CheckpointStore(str(tmp_path), keep_last=100)
    graceful_stop.request_stop(graceful_stop.leaving("w", "stop_sigterm"))
    try:
        with pytest.raises(graceful_stop.StopRequested, match=r"\(SIGTERM\).* epoch 1 step 2 "):
            train(store, every_steps=0)
    finally:
        graceful_stop.clear()
    assert store.latest_uri() == store.uri_for(0, 2), "a checkpoint at the stop's step"
    reference, _, _ = train(CheckpointStore(str(tmp_path / "ref"), 100), every_steps=0)
    resumed, _, position = train(store, every_steps=0)
    assert position is not None and position.step == 2
    assert_same(weights(resumed), weights(reference))


# docs/fault-tolerance.md "What a resumed epoch reports": the epoch a step checkpoint resumed
# reports the rate and time of the steps run since the resume, so its samples/s is the
# uninterrupted run's, not the whole epoch's samples over the resumed part's seconds.
def test_a_resumed_epoch_reports_the_rate_of_the_steps_since_the_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Every step costs the same 50 ms on fit's clock: a wall clock on a loaded 2-core
    # machine varies more between two runs than the 25 % this checks.
    now = [0.0]
    monkeypatch.setattr(training_loop, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def step_cost() -> None:
        now[0] += 0.05

    reference_log = Recording()
    train(CheckpointStore(str(tmp_path / "ref"), 100), 5, None, reference_log, on_batch=step_cost)
    store = CheckpointStore(str(tmp_path / "run"), keep_last=100)
    train(store, 5, crash_at_batch=STEPS + 1 + 8, on_batch=step_cost)  # epoch 2, after 7 steps
    log = Recording()
    _, _, position = train(store, 5, logger=log, on_batch=step_cost)
    assert position is not None and (position.epoch, position.step) == (1, 5)

    def epoch_2(recorded: Recording, key: str) -> float:
        (value,) = [v for step, v in recorded.series(key) if step == 2]
        return value

    resumed = epoch_2(log, "epoch_samples_per_s")
    uninterrupted = epoch_2(reference_log, "epoch_samples_per_s")
    assert abs(resumed / uninterrupted - 1) <= 0.25, (resumed, uninterrupted)
    # Its time is the 7 steps since the resume, not the epoch's 12.
    assert epoch_2(log, "epoch_time_s") == pytest.approx(7 * 0.05)
    assert epoch_2(reference_log, "epoch_time_s") == pytest.approx(12 * 0.05)


@pytest.mark.parametrize(
    ("written_at", "resumed_at", "line"),
    [
        # 38,592 samples in batches of 32 per rank: 603 steps at 2 ranks, 402 at 3. Step
        # 540 at 2 ranks is 34,560 samples done: 360 steps at 3 ranks.
        (2, 3, "step 360/402 at 3 rank(s) (a checkpoint inside the epoch, written at "
         "step 540 of 2 rank(s))"),
        (2, 2, "step 540/603 at 2 rank(s) (a checkpoint inside the epoch)"),
        (2, 1, "step 1080/1206 at 1 rank(s) (a checkpoint inside the epoch, written at "
         "step 540 of 2 rank(s))"),
    ],
)  # fmt: skip
def test_the_resume_line_counts_its_step_and_total_at_one_world_size(
    written_at: int, resumed_at: int, line: str
):
    plan = FitPlan(epochs=3, batch_size=32, seed=0, start_epoch=1)
    position = EpochPosition(1, 540, 540 * 32 * written_at, written_at, [[0.0, 0.0]] * 2)
    per_epoch = -(-38_592 // (32 * resumed_at))
    text = resume_line(position, plan, 38_592, resumed_at, per_epoch)
    assert text == f"resuming at epoch 2/3, {line}"
    done, total = (int(n) for n in text.split("step ", 1)[1].split(" ", 1)[0].split("/"))
    assert done <= total
