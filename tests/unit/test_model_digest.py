"""The digest a registered version is tagged with, and the scope that refuses pickle.

The digest is a SHA-256 over every file's SHA-256 in path order (the lines `sha256sum`
prints), so a change to any file (MLmodel included) changes it; a link is refused. The pickle
setting reads "false" while any of overlapping loads runs and comes back as the user had it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from ddpflow.registry.load import PICKLE_SETTING, model_digest, pickle_refused
from ddpflow.registry.read import RegistryError


def saved_model(folder: Path) -> Path:
    """The files MLflow's pytorch flavour saves (contents made up)."""
    (folder / "data").mkdir(parents=True)
    (folder / "MLmodel").write_text("flavors:\n  pytorch:\n    model_data: data\n")
    (folder / "data" / "model.pt2").write_bytes(bytes(range(256)) * 9)
    (folder / "requirements.txt").write_text("torch==2.14.1\n")
    (folder / "input_example.json").write_text("[[0, 1]]\n")
    return folder


def test_the_digest_is_that_of_the_sorted_sha256sum_lines(tmp_path):
    """The manifest, spelled out (the integration test checks it against coreutils too)."""
    folder = saved_model(tmp_path / "model")
    manifest = "".join(
        f"{hashlib.sha256((folder / name).read_bytes()).hexdigest()}  {name}\n"
        for name in ["MLmodel", "data/model.pt2", "input_example.json", "requirements.txt"]
    )
    assert model_digest(folder) == hashlib.sha256(manifest.encode()).hexdigest()


def test_an_empty_folder_has_no_digest(tmp_path):
    with pytest.raises(RegistryError, match="holds no model files"):
        model_digest(tmp_path)


@pytest.mark.parametrize("changed", ["MLmodel", "data/model.pt2", "data/extra.py"])
def test_any_changed_or_added_file_changes_the_digest(tmp_path, changed):
    folder = saved_model(tmp_path / "model")
    before = model_digest(folder)
    with (folder / changed).open("a") as file:
        file.write("#")
    assert model_digest(folder) != before


def test_a_link_in_the_model_files_is_refused_naming_it(tmp_path):
    folder = saved_model(tmp_path / "model")
    (folder / "data" / "weights").symlink_to(tmp_path)
    with pytest.raises(RegistryError, match=r"data/weights in the model's files"):
        model_digest(folder)


def test_overlapping_loads_refuse_pickle_until_the_last_ends(monkeypatch):
    monkeypatch.setenv(PICKLE_SETTING, "true")
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[str | None] = []

    def first() -> None:
        with pickle_refused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with pickle_refused():
            second_in.set()
            first_out.wait(5)
            seen.append(os.environ.get(PICKLE_SETTING))  # the first one has left

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == ["false"]
    assert os.environ[PICKLE_SETTING] == "true"

    monkeypatch.delenv(PICKLE_SETTING)
    with pickle_refused():
        assert os.environ[PICKLE_SETTING] == "false"
    assert PICKLE_SETTING not in os.environ
