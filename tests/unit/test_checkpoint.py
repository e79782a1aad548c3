"""Checkpoints and the artifact store: round trips, the latest pointer, pruning, atomicity."""

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from torch import nn

from ddpflow import storage
from ddpflow.checkpoint.store import POINTER_NAME, CheckpointStore, build_state, encode, unwrap
from ddpflow.config import STORE_OUTAGE_ENV
from ddpflow.storage.retry import OutageTooLong
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.model import CharLSTM

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


CONFIG = CharLSTMConfig(hidden_size=8, num_layers=2)


def trained_pair(seed: int = 0) -> tuple[CharLSTM, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = CharLSTM(CONFIG)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, CONFIG.vocab_size, (4, 8))
    y = torch.randint(0, CONFIG.vocab_size, (4, 8))
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    return model, optimizer


def small_state(epoch: int) -> dict:
    return {"epoch": epoch, "model_state": {"w": torch.full((2,), float(epoch))}}


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"memory://ddpflow-test-{uuid.uuid4().hex}"
    yield root
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


# --- round trip -------------------------------------------------------------------------------


def test_build_state_round_trip(tmp_path: Path) -> None:
    model, optimizer = trained_pair()
    state = build_state(model, optimizer, 5, CONFIG.to_dict(), extra={"val_loss": 1.25})
    store = CheckpointStore(str(tmp_path / "ckpt"))
    uri = store.save(state)
    assert uri == str(tmp_path / "ckpt" / "epoch-0005.pt")

    loaded = store.load()  # weights_only=True under the hood
    assert loaded["epoch"] == 5
    assert loaded["format_version"] == 1
    assert loaded["model_config"] == {
        "vocab_size": 31,
        "hidden_size": 8,
        "num_layers": 2,
        "dropout": 0.1,
    }
    assert loaded["extra"] == {"val_loss": 1.25}

    rebuilt = CharLSTM(CharLSTMConfig.from_dict(loaded["model_config"]))
    rebuilt.load_state_dict(loaded["model_state"])
    original = model.state_dict()
    for name, tensor in rebuilt.state_dict().items():
        assert torch.equal(tensor, original[name]), name

    fresh = torch.optim.Adam(rebuilt.parameters(), lr=1e-2)
    fresh.load_state_dict(loaded["optimizer_state"])
    restored = fresh.state_dict()
    assert restored["param_groups"][0]["lr"] == 1e-2
    assert len(restored["state"]) == len(list(model.parameters()))
    for key, value in optimizer.state_dict()["state"].items():
        assert torch.equal(restored["state"][key]["exp_avg"], value["exp_avg"])
        assert torch.equal(restored["state"][key]["step"], value["step"])


def test_load_uses_weights_only(tmp_path: Path) -> None:
    # A pickled object that is not plain data must be refused, not executed.
    path = tmp_path / "evil.pt"
    torch.save({"epoch": 1, "obj": CharLSTMConfig()}, path)
    with pytest.raises(Exception, match="(?i)weights_only"):
        storage.load_torch(str(path))


def test_encode_matches_saved_bytes(tmp_path: Path) -> None:
    model, optimizer = trained_pair()
    state = build_state(model, optimizer, 1, CONFIG.to_dict())
    data = encode(state)
    store = CheckpointStore(str(tmp_path))
    uri = store.save_encoded(1, data)
    assert storage.read_bytes(uri, len(data)) == data


def test_unwrap_plain_module_is_identity() -> None:
    model = nn.Linear(2, 2)
    assert unwrap(model) is model


def test_unwrap_ddp_wrapper_and_state_keys_have_no_module_prefix() -> None:
    model, optimizer = trained_pair()
    # A DistributedDataParallel shell without a process group: only `.module` matters here.
    wrapper = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper.module = model
    assert unwrap(wrapper) is model
    state = build_state(wrapper, optimizer, 1, CONFIG.to_dict())
    assert set(state["model_state"]) == set(model.state_dict())
    assert not any(k.startswith("module.") for k in state["model_state"])


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(str(tmp_path), keep_last=0)


# --- pointer and pruning ----------------------------------------------------------------------


def test_load_without_checkpoint_raises(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "none"))
    assert store.latest_uri() is None
    assert store.list_uris() == []
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        store.load()


def test_latest_pointer_names_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=5)
    for epoch in (1, 2, 3):
        store.save(small_state(epoch))
        assert store.latest_uri() == store.uri_for(epoch)
    pointer = json.loads((tmp_path / POINTER_NAME).read_text())
    assert pointer == {"uri": store.uri_for(3), "epoch": 3}
    assert store.load()["epoch"] == 3
    assert store.load(store.uri_for(1))["epoch"] == 1


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_keep_last_keeps_only_the_newest(tmp_path: Path, keep_last: int) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=keep_last)
    for epoch in range(1, 7):
        store.save(small_state(epoch))
    expected = [f"epoch-{e:04d}.pt" for e in range(7 - keep_last, 7)]
    assert files_in(tmp_path) == sorted([*expected, POINTER_NAME])
    assert store.list_uris() == [store.uri_for(e) for e in range(7 - keep_last, 7)]


def test_pointer_target_survives_pruning(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=1)
    store.save(small_state(5))
    # An out-of-order save (e.g. a stale rewrite) must not delete what the pointer names.
    storage.write_bytes(store.uri_for(9), encode(small_state(9)))
    store.save(small_state(2))
    assert store.latest_uri() == store.uri_for(2)
    assert store.load()["epoch"] == 2


def test_other_files_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    store = CheckpointStore(str(tmp_path), keep_last=1)
    for epoch in (1, 2, 3):
        store.save(small_state(epoch))
    assert files_in(tmp_path) == ["epoch-0003.pt", POINTER_NAME, "notes.txt"]


# --- interrupted writes -----------------------------------------------------------------------


class HalfWriteFile:
    """A file whose write stores half of the data and then fails (a crash mid-write)."""

    def __init__(self, path: str, mode: str):
        self._f = open(path, mode)  # noqa: SIM115 - closed in __exit__

    def __enter__(self) -> "HalfWriteFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def write(self, data: bytes) -> int:
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError("disk went away")


def test_interrupted_checkpoint_write_keeps_previous_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=3)
    store.save(small_state(1))
    store.save(small_state(2))

    real_open = open

    def flaky_open(path, mode="r", *args, **kwargs):
        if "epoch-0003.pt" in str(path) and "w" in mode:
            return HalfWriteFile(path, mode)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(storage, "open", flaky_open, raising=False)
    monkeypatch.setenv(STORE_OUTAGE_ENV, "0.3")  # waited out briefly, then given up
    with pytest.raises(OSError, match="disk went away"):
        store.save(small_state(3))
    monkeypatch.undo()

    assert store.latest_uri() == store.uri_for(2)
    assert store.load()["epoch"] == 2
    assert files_in(tmp_path) == ["epoch-0001.pt", "epoch-0002.pt", POINTER_NAME]
    assert not any(".tmp-" in name for name in files_in(tmp_path))


def test_failing_write_bytes_keeps_previous_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=3)
    store.save(small_state(1))
    store.save(small_state(2))
    real_write = storage.write_bytes

    def failing_write(uri: str, data: bytes) -> None:
        if uri.endswith("epoch-0003.pt"):
            raise ConnectionError("upload cut off")
        real_write(uri, data)

    monkeypatch.setattr(storage, "write_bytes", failing_write)
    monkeypatch.setenv(STORE_OUTAGE_ENV, "0.3")  # waited out briefly, then given up
    with pytest.raises(OutageTooLong, match="upload cut off"):
        store.save(small_state(3))
    assert store.latest_uri() == store.uri_for(2)
    assert store.load()["epoch"] == 2
    assert "epoch-0003.pt" not in files_in(tmp_path)


# --- the same on an fsspec filesystem ---------------------------------------------------------


def test_memory_filesystem_pointer_and_prune(memory_root: str) -> None:
    store = CheckpointStore(memory_root, keep_last=2)
    assert store.latest_uri() is None
    for epoch in range(1, 5):
        uri = store.save(small_state(epoch))
        assert uri == f"{memory_root}/epoch-{epoch:04d}.pt"
        assert store.latest_uri() == uri
    assert storage.list_names(memory_root) == ["epoch-0003.pt", "epoch-0004.pt", POINTER_NAME]
    assert store.list_uris() == [store.uri_for(3), store.uri_for(4)]
    loaded = store.load()
    assert loaded["epoch"] == 4
    assert torch.equal(loaded["model_state"]["w"], torch.full((2,), 4.0))


def test_memory_filesystem_model_round_trip(memory_root: str) -> None:
    model, optimizer = trained_pair()
    store = CheckpointStore(memory_root + "/", keep_last=1)
    store.save(build_state(model, optimizer, 1, CONFIG.to_dict()))
    loaded = store.load()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model_state"][name], tensor)


# --- storage helpers ----------------------------------------------------------------------------


def test_write_bytes_local_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "dir" / "blob.bin"
    storage.write_bytes(str(target), b"hello")
    assert target.read_bytes() == b"hello"
    storage.write_bytes(str(target), b"replaced")
    assert target.read_bytes() == b"replaced"
    assert os.listdir(target.parent) == ["blob.bin"]


def test_write_bytes_local_failure_leaves_no_temp_and_keeps_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "blob.bin"
    storage.write_bytes(str(target), b"old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(storage.os, "replace", broken_replace)
    with pytest.raises(OSError, match="rename failed"):
        storage.write_bytes(str(target), b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["blob.bin"]


def test_write_bytes_half_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "open", HalfWriteFile, raising=False)
    with pytest.raises(OSError, match="disk went away"):
        storage.write_bytes(str(tmp_path / "x.bin"), b"0123456789")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_storage_exists_read_delete_list(tmp_path: Path) -> None:
    uri = storage.join(str(tmp_path), "a", "b.bin")
    assert not storage.exists(uri)
    assert storage.list_names(str(tmp_path / "missing")) == []
    storage.write_bytes(uri, b"x")
    assert storage.exists(uri)
    assert storage.read_bytes(uri, 1) == b"x"
    assert storage.list_names(str(tmp_path / "a")) == ["b.bin"]
    storage.delete(uri)
    assert not storage.exists(uri)
    storage.delete(uri)  # deleting twice is fine


def test_save_torch_returns_size(tmp_path: Path) -> None:
    uri = str(tmp_path / "t.pt")
    size = storage.save_torch(uri, {"t": torch.arange(3)})
    assert size == os.path.getsize(uri)
    assert torch.equal(storage.load_torch(uri)["t"], torch.arange(3))


@pytest.mark.parametrize(
    ("base", "parts", "expected"),
    [
        ("/tmp/root", ("a", "b.pt"), "/tmp/root/a/b.pt"),
        ("/tmp/root/", ("a/", "/b.pt"), "/tmp/root/a/b.pt"),
        ("s3://bucket", ("runs", "1"), "s3://bucket/runs/1"),
        ("s3://bucket/prefix/", ("/runs/", "ckpt"), "s3://bucket/prefix/runs/ckpt"),
        ("s3://bucket/prefix", ("", "/", "x"), "s3://bucket/prefix/x"),
        ("memory://root", (), "memory://root"),
    ],
)
def test_join(base: str, parts: tuple[str, ...], expected: str) -> None:
    assert storage.join(base, *parts) == expected


def test_sha256_hex() -> None:
    expected = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert storage.sha256_hex(b"hello") == expected
