"""ImageNet weights through the hub cache: hash-checked every time, unpickled weights-only.

The real loader runs on files the tests make: a download from a local file:// URL into a
temporary hub cache (TORCH_HOME), and files placed in that cache under the name torchvision
expects. Nothing is mocked; nothing reaches the network.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest
import torch
import torchvision

from ddpflow.workloads.vision.model import build_resnet
from ddpflow.workloads.vision.pretrained import (
    WeightsError,
    fetch_imagenet_state,
    hub_cache_path,
    load_hub_weights,
)
from tests.helpers.within import outcome_within, raises_within

pytestmark = pytest.mark.timeout(60)
STATE = {"w": torch.arange(4.0), "b": torch.ones(2)}
CAP = 2**20


@pytest.fixture(autouse=True)
def hub_cache(monkeypatch, tmp_path: Path) -> Path:
    """An empty hub cache of this test's own; torch.hub.get_dir() reads TORCH_HOME per call."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def served(folder: Path, data: bytes, name: str = "tiny", digest: str | None = None) -> str:
    """A file named as torch.hub names its files (`<name>-<sha256 prefix>.pth`); its URL."""
    folder.mkdir(parents=True, exist_ok=True)
    digest = digest or hashlib.sha256(data).hexdigest()[:8]
    path = folder / f"{name}-{digest}.pth"
    path.write_bytes(data)
    return path.as_uri()


def test_a_download_lands_in_the_hub_cache_and_loads_from_it(tmp_path, hub_cache) -> None:
    url = served(tmp_path / "server", saved(STATE))
    state = outcome_within(30, lambda: load_hub_weights(url, CAP))
    assert torch.equal(state["w"], STATE["w"])
    cached = Path(hub_cache_path(url))
    assert cached.parent == hub_cache and cached.read_bytes() == saved(STATE)
    os.remove(url.removeprefix("file://"))  # the next load is from the cache alone
    assert torch.equal(load_hub_weights(url, CAP)["b"], STATE["b"])
    assert [p.name for p in hub_cache.iterdir()] == [cached.name]  # no partial file left


def test_a_tampered_cached_file_is_refused_by_the_hash_check(hub_cache) -> None:
    """torch.hub loads a cached file unchecked; here the hash in its name is checked."""
    resnet = torchvision.models.get_model_weights("resnet18").DEFAULT
    cached = Path(hub_cache_path(resnet.url))
    assert cached.name == "resnet18-f37072fd.pth"
    hub_cache.mkdir(parents=True)
    cached.write_bytes(saved(torchvision.models.resnet18().state_dict()))  # loadable, not theirs
    message = raises_within(30, WeightsError, lambda: fetch_imagenet_state("resnet18"))
    assert str(cached) in message and "not f37072fd" in message
    assert f"delete {cached}" in message
    with pytest.raises(WeightsError, match="damaged or was replaced"):
        build_resnet("resnet18", 3, weights="imagenet")


def test_a_download_whose_hash_does_not_match_is_not_kept(tmp_path, hub_cache) -> None:
    url = served(tmp_path / "server", saved(STATE), digest="00000000")
    message = raises_within(30, WeightsError, lambda: load_hub_weights(url, CAP))
    assert "resnet" not in message and "tiny-00000000.pth" in message and "not kept" in message
    assert not hub_cache.exists() or not list(hub_cache.iterdir())


class RunsCode:
    """Unpickling this calls open(marker, "w"): what a hostile .pth does with os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_that_runs_code_is_refused_by_weights_only(tmp_path, hub_cache) -> None:
    marker = tmp_path / "code-ran"
    url = served(tmp_path / "server", saved({"w": torch.ones(1), "x": RunsCode(marker)}))
    message = raises_within(30, WeightsError, lambda: load_hub_weights(url, CAP))
    assert "weights_only=True" in message and hub_cache_path(url) in message
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["fifo", "directory", "/dev/zero"])
def test_a_cached_entry_that_is_no_regular_file_is_refused_at_once(
    kind: str, tmp_path: Path, hub_cache: Path
) -> None:
    url = (tmp_path / "server" / "tiny-0123abcd.pth").as_uri()  # never read: the cache has it
    cached = Path(hub_cache_path(url))
    hub_cache.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(cached)
    elif kind == "directory":
        cached.mkdir()
    else:
        cached.symlink_to("/dev/zero")
    message = raises_within(10, WeightsError, lambda: load_hub_weights(url, CAP))
    assert str(cached) in message and "not a regular file" in message
    assert f"delete {cached}" in message


def test_a_download_over_the_listed_size_is_cut_off(tmp_path, hub_cache) -> None:
    data = saved({"w": torch.zeros(100_000)})
    url = served(tmp_path / "server", data)
    message = raises_within(30, WeightsError, lambda: load_hub_weights(url, len(data) - 1))
    assert f"more than {len(data) - 1} bytes" in message
    assert not hub_cache.exists() or not list(hub_cache.iterdir())
