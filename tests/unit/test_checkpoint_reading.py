"""ddpflow.load_checkpoint: a training's checkpoint read outside training (docs/api.md
"Reading a checkpoint"), from its folder or one file, weights-only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpflow
from ddpflow.checkpoint.steps import EpochPosition
from ddpflow.checkpoint.store import CheckpointStore, pack_state


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(16, 4)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def _write(root: Path) -> tuple[nn.Module, torch.optim.Optimizer, CheckpointStore]:
    store = CheckpointStore(str(root))
    model, optimizer = _trained(0)
    store.save(pack_state(1, {"model": model, "optimizer": optimizer}, {"note": "first"}))
    model, optimizer = _trained(1)
    position = EpochPosition(epoch=2, step=7, samples=112, world_size=2, loss_sums=[[1.0, 8]] * 2)
    state = pack_state(2, {"model": model, "optimizer": optimizer}, {"note": "newest"})
    store.save({**state, "position": position.to_dict()})
    return model, optimizer, store


def test_the_folder_gives_the_latest_checkpoint_into_the_objects(tmp_path):
    model, optimizer, store = _write(tmp_path / "ckpt")
    fresh, _ = _trained(99)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    loaded = ddpflow.load_checkpoint(str(tmp_path / "ckpt"), model=fresh, optimizer=fresh_optimizer)
    assert loaded.uri == store.latest_uri() and loaded.uri.endswith("epoch-0002.step-00000007.pt")
    assert loaded.step == 2 and loaded.names == ["model", "optimizer"]
    assert loaded.position is not None and loaded.position.step == 7
    assert loaded.info == {"note": "newest"} and loaded.format_version == 1
    for mine, theirs in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1


def test_one_file_and_a_subset_of_the_objects(tmp_path):
    _write(tmp_path / "ckpt")
    first = tmp_path / "ckpt" / "epoch-0001.pt"
    model, _ = _trained(0)
    fresh, _ = _trained(42)
    loaded = ddpflow.load_checkpoint(str(first), model=fresh)  # no optimizer: fine
    assert loaded.step == 1 and loaded.position is None and loaded.info == {"note": "first"}
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_the_latest_pointer_is_the_documented_format(tmp_path):
    _, _, store = _write(tmp_path / "ckpt")
    pointer = json.loads((tmp_path / "ckpt" / "latest.json").read_text())
    assert pointer == {"uri": store.latest_uri(), "epoch": 2}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.mkdir(), "has no latest.json"),
        (lambda p: torch.save({"weights": torch.zeros(1)}, p.with_suffix(".pt")), "not a ddpflow"),
    ],
)
def test_a_folder_or_file_that_is_no_checkpoint_is_named(tmp_path, make, message):
    target = tmp_path / "elsewhere"
    make(target)
    uri = str(target if target.exists() else target.with_suffix(".pt"))
    with pytest.raises((FileNotFoundError, ValueError), match=message) as error:
        ddpflow.load_checkpoint(uri, model=nn.Linear(1, 1))
    assert uri in str(error.value)


def test_a_name_the_checkpoint_does_not_hold_is_refused_before_loading(tmp_path):
    _write(tmp_path / "ckpt")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(ValueError, match=r"\['scheduler'\].*holds \['model', 'optimizer'\]"):
        ddpflow.load_checkpoint(str(tmp_path / "ckpt"), model=model, scheduler=object())
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values(), strict=True))


def test_a_newer_format_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "epoch-0001.pt"
    torch.save({"format_version": 99, "epoch": 1, "model_state": {}}, path)
    with pytest.raises(ValueError, match="format 99.*upgrade ddpflow"):
        ddpflow.load_checkpoint(str(path))
