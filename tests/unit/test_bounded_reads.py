"""Every whole-file read is bounded: a regular file only, under a cap, within a deadline.

Each bad input (a FIFO, /dev/zero, a directory, an oversized file) is given where a user or
a registry tag can name it: weights= (the `resolve-weights` task's function), a checkpoint
file or folder (`ddpflow.load_checkpoint`, the evaluations), its `latest.json`, a registry
version's checkpoint tag (champion scoring, on a real MLflow SQLite registry), a corpus
source, and an object-store URI (fsspec's in-memory filesystem). Each must fail with an error
naming the input and the fix within a few seconds: the calls run on a thread that the test
waits for only so long, so a regression fails here instead of hanging the run.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from mlflow.tracking import MlflowClient

from ddpflow import storage
from ddpflow.checkpoint.reading import load_checkpoint
from ddpflow.checkpoint.store import CheckpointStore
from ddpflow.config import MAX_LOAD_ENV, ConfigError, Settings
from ddpflow.registry.read import RegistryError, tag_checkpoint
from ddpflow.storage import capped_read
from ddpflow.storage.capped_read import ReadRefused, TooLarge, read_capped
from ddpflow.workloads.charlm.champion import score_version
from ddpflow.workloads.charlm.corpus import CorpusError, load_names
from ddpflow.workloads.charlm.evaluation import load_model
from ddpflow.workloads.vision.model import resolve_weights
from tests.helpers.champion_helpers import (
    add_version,
    constant_model,
    save_checkpoint,
    write_holdout,
)
from tests.helpers.within import raises_within

pytestmark = pytest.mark.timeout(120)
BOUND_S = 10  # what each refusal may take; the good path reads a few KB
BAD = ["fifo", "/dev/zero", "directory"]
KIND = {"fifo": "a FIFO", "/dev/zero": "a character device", "directory": "a directory"}


def bad_entry(path: Path, kind: str) -> str:
    """Make `path` the bad input; its text as a user would pass it."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return str(path)


def refused(fn: Callable[[], object], error: type[Exception] = ReadRefused) -> str:
    return raises_within(BOUND_S, error, fn)


@pytest.mark.parametrize("kind", BAD)
def test_read_bytes_refuses_what_is_not_a_regular_file(kind: str, tmp_path: Path) -> None:
    uri = bad_entry(tmp_path / "input.json", kind)
    message = refused(lambda: storage.read_bytes(uri, 2**20, "pass a JSON file"))
    assert f"{uri} is not a regular file (it is {KIND[kind]}); pass a JSON file" in message


def test_read_bytes_refuses_a_file_over_its_cap_before_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(2**30)  # sparse: 1 GiB that costs nothing unless it is read
    message = refused(lambda: storage.read_bytes(str(path), 2**20, "pass a smaller file"), TooLarge)
    assert str(path) in message and "1 MiB (1048576 bytes) cap" in message
    assert f"({2**30} bytes or more); pass a smaller file" in message


def test_an_object_store_entry_is_capped_and_must_be_a_file() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/bounded-test/big.pt", b"x" * 5000)
    fs.mkdir("/bounded-test/folder")
    try:
        big = "memory://bounded-test/big.pt"
        message = refused(lambda: storage.read_bytes(big, 4096), TooLarge)
        assert f"{big} is larger than" in message and "5000 bytes" in message
        message = refused(lambda: storage.read_bytes("memory://bounded-test/folder", 4096))
        assert "is not a file (it is a directory)" in message
        assert storage.read_bytes(big, 5000) == b"x" * 5000
    finally:
        fs.rm("/bounded-test", recursive=True)


@pytest.mark.parametrize("kind", BAD)
def test_weights_that_are_no_regular_file_fail_the_resolve_weights_step(
    kind: str, tmp_path: Path
) -> None:
    uri = bad_entry(tmp_path / "weights.pt", kind)
    message = refused(lambda: resolve_weights("resnet18", uri, str(tmp_path / "artifacts")))
    assert f"{uri} is not a regular file" in message
    assert "pass weights= the URI of a saved state_dict" in message


def test_a_checkpoint_over_the_load_cap_names_the_setting(monkeypatch, tmp_path: Path) -> None:
    uri = str(tmp_path / "big.pt")
    storage.save_torch(uri, {"w": torch.zeros(2**19)})  # 2 MiB of float32
    monkeypatch.setenv(MAX_LOAD_ENV, "1")
    message = refused(lambda: load_checkpoint(uri), TooLarge)
    assert uri in message and "pass a checkpoint file or folder written by ddpflow" in message
    assert f"or raise {MAX_LOAD_ENV} (now 1)" in message
    monkeypatch.setenv(MAX_LOAD_ENV, "3")
    with pytest.raises(ValueError, match="not a ddpflow checkpoint"):  # read, then judged
        load_checkpoint(uri)


def test_a_bad_load_cap_setting_fails_with_the_settings() -> None:
    with pytest.raises(ConfigError, match=f"{MAX_LOAD_ENV}='lots' is not a size in MiB"):
        Settings.from_env({MAX_LOAD_ENV: "lots"})
    assert Settings.from_env({MAX_LOAD_ENV: "64"}).max_load_bytes == 64 * 2**20


@pytest.mark.parametrize("kind", BAD)
def test_a_checkpoint_that_is_no_regular_file_is_refused(kind: str, tmp_path: Path) -> None:
    uri = bad_entry(tmp_path / "epoch-0001.pt", kind)
    for load in (lambda: load_checkpoint(uri), lambda: load_model(uri)):
        message = refused(load)
        assert f"{uri} is not a regular file" in message and "written by ddpflow" in message


@pytest.mark.parametrize("kind", [*BAD, "oversized", "not json", "names /dev/zero"])
def test_a_bad_latest_json_is_refused(kind: str, tmp_path: Path) -> None:
    pointer = tmp_path / "latest.json"
    if kind == "oversized":
        pointer.write_text(json.dumps({"uri": "x" * 2**20}))  # parses, and names nothing
    elif kind == "not json":
        pointer.write_bytes(b"\xff\xfe not json")
    elif kind == "names /dev/zero":
        pointer.write_text(json.dumps({"uri": "/dev/zero", "epoch": 1}))
    else:
        bad_entry(pointer, kind)
    for load in (
        lambda: load_checkpoint(str(tmp_path)),
        lambda: CheckpointStore(str(tmp_path)).load(),
    ):
        message = refused(load, ValueError)
        if kind == "oversized":
            assert f"cap on this input ({2**20 + 11} bytes or more)" in message
        if kind == "names /dev/zero":  # the pointer is fine; what it names is refused
            assert "/dev/zero is not a regular file" in message
            assert "pass a checkpoint file or folder written by ddpflow" in message
        else:
            assert str(pointer) in message
            assert "pass a training's checkpoint_dir, whose latest.json ddpflow wrote" in message


def test_a_registry_tag_naming_no_regular_file_fails_the_scoring(tmp_path: Path) -> None:
    """A real MLflow registry on SQLite; a version's checkpoint tag names the bad input."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    val_uri = write_holdout(tmp_path, num_names=50)
    version, _ = add_version(client, "tagged", constant_model(torch.zeros(31)), tmp_path)
    for kind in ("fifo", "/dev/zero"):
        uri = bad_entry(tmp_path / f"champion-{kind.strip('/').replace('/', '-')}.pt", kind)
        tag_checkpoint(client, "tagged", version, uri)
        message = refused(lambda: score_version(client, "tagged", version, val_uri), RegistryError)
        assert f"version {version}: cannot load its ddpflow checkpoint {uri}" in message
        assert f"is not a regular file (it is {KIND[kind]})" in message


@pytest.mark.parametrize("kind", [*BAD, "oversized"])
def test_a_corpus_file_that_cannot_be_read_whole_is_refused(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "names.json"
    if kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(101 * 2**20)
    else:
        bad_entry(path, kind)
    message = refused(lambda: load_names(path), CorpusError)
    assert str(path) in message
    assert "over the 100 MiB cap" in message if kind == "oversized" else "not a regular" in message


def test_good_files_still_read(tmp_path: Path) -> None:
    uri = save_checkpoint(constant_model(torch.zeros(31)), tmp_path / "run")
    model, epoch = load_model(uri)
    assert epoch == 1 and model.config.hidden_size == 8
    assert load_checkpoint(str(tmp_path / "run")).uri == uri


class StalledFS(MemoryFileSystem):
    """A store that stops answering (no server here can be paused): `stall` blocks its
    listing or its reads until the test releases it."""

    protocol = "stalled"
    cachable = False  # fsspec would hand the next test this instance, released

    def __init__(self, stall: str) -> None:
        super().__init__()
        self.stall = stall
        self.release = threading.Event()

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        if self.stall == "listing":
            self.release.wait()
        return super().info(path, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if self.stall == "reading" and "r" in mode:
            self.release.wait()
        return super()._open(path, mode, **kwargs)


@pytest.mark.parametrize("stall", ["listing", "reading"])
def test_a_read_from_a_store_that_stops_answering_ends_at_its_deadline(
    stall: str, monkeypatch
) -> None:
    monkeypatch.setattr(capped_read, "READ_TIMEOUT_BASE_S", 0.5)
    fs = StalledFS(stall)
    fs.pipe_file("/stalled/ckpt.pt", b"x" * 100)
    try:
        message = raises_within(
            BOUND_S,
            TimeoutError,
            lambda: read_capped(fs, "/stalled/ckpt.pt", "s3://b/ckpt.pt", 200, ""),
        )
        # Listing waits the base; reading, the base plus the size at READ_BYTES_PER_S.
        deadline = "0.5s" if stall == "listing" else "0.50002s"
        assert message == f"{stall} s3://b/ckpt.pt did not finish within {deadline}"
    finally:
        fs.release.set()
        fs.rm("/stalled", recursive=True)
