"""The public API's pure parts: TrainContext (without a process group) and ddpflow.run's
input checks that need no cluster."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpflow
from ddpflow.api import check_callbacks, check_tracking, check_train
from ddpflow.cluster.build import LOOPBACK_DASHBOARD
from ddpflow.distributed.context import RankContext
from ddpflow.training.context import TrainContext
from ddpflow.training.settings import TrainSettings, check_seed

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


def context(rank: int = 0, world_size: int = 1, checkpoint_dir: str | None = None, seed=0):
    rank_ctx = RankContext(rank, world_size, torch.device("cpu"), "gloo")
    return TrainContext(rank_ctx, TrainSettings(checkpoint_dir, keep_last=2, seed=seed))


def test_public_names_are_exported_lazily():
    # docs/api.md "Reference": these are the public names.
    assert {"run", "TrainContext", "Restart", "LaunchError"} <= set(ddpflow.__all__)
    assert all(getattr(ddpflow, name) for name in ddpflow.__all__)


def test_shard_gives_each_rank_a_fixed_disjoint_part():
    parts = [context(r, 3).shard(10) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    rows = torch.arange(20).reshape(10, 2)
    assert torch.equal(context(1, 3).shard(rows), rows[parts[1]])
    assert context(2, 3).shard("abcdefg") == ["c", "f"]
    with pytest.raises(TypeError, match="shard\\(data\\) takes a count"):
        context().shard(3.5)


def test_batches_cover_each_sample_once_in_equal_steps():
    ranks = [context(r, 2, seed=5).batches(101, 8, epoch=3) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    assert sorted(torch.cat([torch.cat(b) for b in ranks]).tolist()) == list(range(101))
    assert not torch.equal(torch.cat(ranks[0]), torch.cat(context(0, 2, seed=5).batches(101, 8, 4)))


def test_reseed_depends_on_seed_rank_and_epoch():
    def draw(ctx: TrainContext, epoch: int) -> torch.Tensor:
        ctx.reseed(epoch)
        return torch.rand(4)

    assert torch.equal(draw(context(0), 2), draw(context(0), 2))
    assert not torch.equal(draw(context(0), 2), draw(context(1, 2), 2))
    assert not torch.equal(draw(context(0), 2), draw(context(0), 3))
    assert not torch.equal(draw(context(0, seed=1), 2), draw(context(0), 2))


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(steps):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def test_resume_restores_every_named_object_in_one_load(tmp_path: Path):
    # docs/api.md "Checkpoints": model, optimizer and any state_dict object come back.
    ctx = context(checkpoint_dir=str(tmp_path))
    assert ctx.resume() == 0, "nothing saved yet: start at 0"
    model, optimizer, scheduler = trained(3)
    ctx.save_checkpoint(3, model=model, optimizer=optimizer, scheduler=scheduler)
    fresh, fresh_optimizer, fresh_scheduler = trained(0)
    step = ctx.resume(model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
    assert step == 3
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.0125
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 3


def test_a_grad_scaler_is_saved_and_resumed_like_any_state_dict_object(tmp_path: Path):
    """fp16 training needs a GPU; the scaler is enabled on CPU here for its state only."""
    ctx = context(checkpoint_dir=str(tmp_path))
    model, optimizer, _ = trained(1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))  # the scale tensor exists from the first scaled loss
    scaler.update(new_scale=96.0)  # as after overflowing steps
    ctx.save_checkpoint(1, model=model, optimizer=optimizer, scaler=scaler)
    fresh = torch.amp.GradScaler("cpu")
    assert ctx.resume(model=model, optimizer=optimizer, scaler=fresh) == 1
    assert fresh.get_scale() == 96.0 and fresh.state_dict() == scaler.state_dict()


def test_resume_names_a_mismatch_with_what_was_saved(tmp_path: Path):
    ctx = context(checkpoint_dir=str(tmp_path))
    model, optimizer, _ = trained(1)
    ctx.save_checkpoint(1, model=model, optimizer=optimizer)
    with pytest.raises(ValueError, match=r"resume\(\) got \['model'\] but the checkpoint holds"):
        ctx.resume(model=model)


def test_checkpoints_need_a_folder_and_a_positive_step(tmp_path: Path):
    model, _, _ = trained(0)
    with pytest.raises(ValueError, match="pass checkpoint_dir="):
        context().save_checkpoint(1, model=model)
    assert context().resume(model=model) == 0, "no folder: nothing to resume"
    with pytest.raises(ValueError, match="step must be >= 1"):
        context(checkpoint_dir=str(tmp_path)).save_checkpoint(0, model=model)
    with pytest.raises(ValueError, match="got nothing to save"):
        context(checkpoint_dir=str(tmp_path)).save_checkpoint(1)


def test_only_rank_0_writes_checkpoints(tmp_path: Path):
    model, _, _ = trained(0)
    context(1, 1, checkpoint_dir=str(tmp_path)).save_checkpoint(1, model=model)
    assert list(tmp_path.iterdir()) == []


def train_fn(ctx: TrainContext, epochs: int, lr: float = 0.1) -> None:
    pass


def test_train_must_be_callable_with_the_args_and_picklable():
    with pytest.raises(TypeError, match="train must be a function"):
        check_train("train.py", ())
    with pytest.raises(TypeError, match="train=train_fn cannot be called as train"):
        check_train(train_fn, (1, 2, 3))
    with pytest.raises(TypeError, match="cannot be sent to the Dask workers"):
        check_train(train_fn, (threading.Lock(),))
    check_train(train_fn, (2,))


def test_tracking_options_must_make_sense():
    with pytest.raises(ValueError, match="need tracking_uri="):
        check_tracking(None, "exp", None)
    with pytest.raises(ValueError, match="not both"):
        check_tracking("sqlite:///m.db", "exp", "abc")
    with pytest.raises(ValueError, match="neither experiment="):
        check_tracking("http://user:hunter2@mlflow:5000", None, None)
    try:
        check_tracking("http://user:hunter2@mlflow:5000", None, None)
    except ValueError as error:
        assert "hunter2" not in str(error), "the password never reaches a message"
    with pytest.raises(ValueError, match="seed=-1 must be an int"):
        check_seed(-1)


def test_progress_callbacks_must_be_functions():
    """docs/api.md "Progress is one channel": a callback that is not a function fails at
    once, naming it, instead of failing every event quietly on the Dask client's loop."""
    with pytest.raises(TypeError, match="on_event must be a function .* got list"):
        check_callbacks(on_progress=print, on_event=[], on_restart=None)
    check_callbacks(on_progress=print, on_event=print.__call__, on_restart=None)


def never_called(ctx) -> None:
    raise AssertionError("bad input must stop ddpflow.run before any rank starts")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"max_restarts": -1}, "max_restarts=-1 must be an int >= 0"),
        ({"keep_last": 0}, "keep_last=0 must be an int >= 1"),
        ({"timeout_s": 0}, "timeout_s=0 must be a number of seconds > 0"),
        ({"seed": -1}, "seed=-1 must be an int from 0 to"),
        ({"world_size": 0}, "world_size=0 must be an int >= 1"),
    ],
)
def test_bad_run_options_fail_before_any_work(tmp_path: Path, option, message):
    """ddpflow.run itself, on an in-process Dask cluster of one worker thread: the error
    names the option, no rank runs and no MLflow store is created."""
    from distributed import Client, LocalCluster

    store = tmp_path / "mlflow.db"
    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=LOOPBACK_DASHBOARD) as cluster,
        Client(cluster) as client,
        pytest.raises(ValueError, match=message),
    ):
        ddpflow.run(
            client,
            never_called,
            tracking_uri=f"sqlite:///{store}",
            experiment="bad-input",
            **option,
        )
    assert not store.exists(), "no MLflow run is created for a call that fails its checks"


def test_checkpoint_info_is_kept_beside_the_objects_and_reserved_names_are_refused(tmp_path):
    """docs/api.md "Checkpoints and resume": `info` holds plain values (a model config) in
    the same file; names that would shadow the format's own keys are refused, naming them."""
    ctx = context(checkpoint_dir=str(tmp_path))
    model, optimizer, _ = trained(1)
    ctx.save_checkpoint(1, info={"model_config": {"width": 3}}, model=model)
    state = torch.load(ctx.latest_checkpoint, weights_only=True)
    assert state["model_config"] == {"width": 3} and "model_state" in state
    for bad in ({"epoch": 5}, {"weights_state": 1}):
        with pytest.raises(ValueError, match=rf"checkpoint info keys \['{next(iter(bad))}'\]"):
            ctx.save_checkpoint(2, info=bad, model=model)
    assert ctx.resume(model=model) == 1, "a refused checkpoint leaves the last one in place"
    # Every rank refuses them at once, before waiting for rank 0's write.
    other = context(rank=1, world_size=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"checkpoint info keys \['epoch'\]"):
        other.save_checkpoint(2, info={"epoch": 5}, model=model)


def test_tensor_pairs_need_one_target_per_input():
    pairs = ddpflow.TensorPairs(torch.arange(6).reshape(3, 2), torch.tensor([0, 1, 0]))
    inputs, targets = pairs.batch(torch.tensor([2, 0]))
    assert inputs.tolist() == [[4, 5], [0, 1]] and targets.tolist() == [0, 0]
    with pytest.raises(ValueError, match="TensorPairs got 3 inputs but 2 targets"):
        ddpflow.TensorPairs(torch.zeros(3, 2), torch.zeros(2))


def test_fit_without_a_checkpoint_folder_trains_and_writes_nothing(tmp_path, monkeypatch):
    """ddpflow.fit with a loss hook on a model that returns logits: the loss falls over the
    epochs, and with no checkpoint_dir nothing is saved anywhere."""
    monkeypatch.chdir(tmp_path)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    history = ddpflow.fit(
        context(rank=0, world_size=1),
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
        train=ddpflow.TensorPairs(x, y),
        val=ddpflow.TensorPairs(x, y),
        epochs=3,
        batch_size=8,
        hooks=ddpflow.FitHooks(loss=nn.functional.cross_entropy),
        checkpoint_every_steps=2,
    )
    assert [s.epoch for s in history] == [1, 2, 3]
    assert history[-1].val_loss < history[0].val_loss
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epochs": 0}, r"fit\(epochs=0\): epochs must be an int >= 1"),
        ({"batch_size": 2.5}, r"fit\(batch_size=2.5\): batch_size must be an int >= 1"),
        ({"world_size": 2}, r"got a Linear on 2 ranks: wrap it .*model=ctx.wrap\(net\)"),
        ({"state": {"optimizer": nn.Linear(1, 1)}}, r"names \['optimizer'\], which fit"),
    ],
)
def test_fit_refuses_bad_input_before_reading_any_checkpoint(tmp_path, kwargs, message):
    ctx = context(world_size=kwargs.pop("world_size", 1), checkpoint_dir=str(tmp_path / "c"))
    net = nn.Linear(4, 2)
    pairs = ddpflow.TensorPairs(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
    options = {"epochs": 1, "batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        ddpflow.fit(
            ctx,
            model=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            train=pairs,
            val=pairs,
            hooks=ddpflow.FitHooks(loss=nn.functional.cross_entropy),
            **options,
        )
    assert not (tmp_path / "c").exists()


def test_fit_returns_every_epoch_after_a_resume(tmp_path):
    """docs/api.md "ddpflow.fit": a relaunched fit (after a restart) returns the epochs before
    it too, read from the checkpoint, equal to what the first call returned for them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = (x[:, 0] > 0).long()

    def call(epochs: int, info=None) -> list:
        torch.manual_seed(0)
        net = nn.Linear(4, 2)
        return ddpflow.fit(
            context(rank=0, world_size=1, checkpoint_dir=str(tmp_path / "ckpt")),
            model=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
            train=ddpflow.TensorPairs(x, y),
            val=ddpflow.TensorPairs(x, y),
            epochs=epochs,
            batch_size=8,
            hooks=ddpflow.FitHooks(loss=nn.functional.cross_entropy),
            info=info,
        )

    first = call(2)  # stands for the attempt a lost worker ended after epoch 2
    resumed = call(4)
    assert [s.epoch for s in resumed] == [1, 2, 3, 4]
    assert resumed[:2] == first
    with pytest.raises(ValueError, match="'fit_history', which fit keeps"):
        call(5, info={"fit_history": []})
