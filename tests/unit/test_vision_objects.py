"""Image folder entries that must not be read, and reads that fail for network reasons."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ddpflow.workloads.vision.data import ImageSpec, format_image_folder
from ddpflow.workloads.vision.image_folder import DatasetError, list_image_folder
from ddpflow.workloads.vision.objects import ImageReadError
from tests.helpers.pngs import png


def two_classes(root: Path, per_class: int = 4) -> Path:
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (root / label / f"{i}.png").write_bytes(png(20 * i + 5))
    return root


def test_a_link_that_stays_inside_the_folder_is_read(tmp_path: Path) -> None:
    root = two_classes(tmp_path / "f")
    os.symlink(root / "cat" / "0.png", root / "dog" / "alias.png")
    index = list_image_folder(str(root))
    assert ("dog/alias.png", 1) in index.samples and not index.skipped


def test_an_image_over_the_cap_is_skipped_naming_the_setting(tmp_path: Path) -> None:
    root = two_classes(tmp_path / "f")
    (root / "dog" / "big.png").write_bytes(png(size=(300, 300)) + b"\0" * 4096)
    index = list_image_folder(str(root), max_image_mb=0.001)
    assert [b.key for b in index.skipped] == ["dog/big.png"]
    assert "max_image_mb" in index.skipped[0].reason
    assert "dog/big.png" not in dict(index.samples)


def test_a_symlinked_class_folder_is_an_error_naming_it(tmp_path: Path) -> None:
    root = two_classes(tmp_path / "f")
    elsewhere = two_classes(tmp_path / "elsewhere")
    os.symlink(elsewhere / "cat", root / "bird")
    with pytest.raises(DatasetError, match=r"'bird'.* symlinks.*copy or bind-mount"):
        list_image_folder(str(root))


class FlakyFileSystem(MemoryFileSystem):
    """An in-memory store whose reads of chosen keys fail with a connection reset first.

    Stands in for S3 because a real server cannot be made to reset a connection on demand
    here; the listing and reading code paths are the ones an s3:// root takes.
    """

    protocol = "flaky"
    failures: dict[str, int] = {}  # path -> reads that fail before one succeeds
    error: type[Exception] = ConnectionResetError

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("flaky://"))

    def cat_file(self, path, start=None, end=None, **kwargs):
        stripped = self._strip_protocol(path)
        if self.failures.get(stripped, 0) > 0:
            self.failures[stripped] -= 1
            raise self.error(f"simulated failure reading {stripped}")
        return super().cat_file(path, start, end, **kwargs)


@pytest.fixture
def flaky() -> str:
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    fs = FlakyFileSystem()
    for label in ("cat", "dog"):
        for i in range(4):
            fs.pipe_file(f"/imgs/{label}/{i}.png", png(30 * i + 7))
    yield "flaky://imgs"
    fs.rm("/imgs", recursive=True)
    FlakyFileSystem.failures = {}
    FlakyFileSystem.error = ConnectionResetError


def _format(root: str, artifacts: Path):
    return format_image_folder(root, str(artifacts), ImageSpec(8), 0.25, 0, 0.5)


def test_a_transient_read_error_is_retried_not_recorded(flaky, tmp_path) -> None:
    FlakyFileSystem.failures = {"/imgs/dog/2.png": 2}
    result = _format(flaky, tmp_path / "art")
    assert result.bad == [] and result.num_train + result.num_val == 8


def test_a_read_that_keeps_failing_fails_the_run_and_caches_nothing(flaky, tmp_path) -> None:
    FlakyFileSystem.failures = {"/imgs/dog/2.png": 100}
    with pytest.raises(ImageReadError, match=r"flaky://imgs/dog/2\.png.*not recorded as a bad"):
        _format(flaky, tmp_path / "art")
    assert not (tmp_path / "art").exists()
    FlakyFileSystem.failures = {}
    assert _format(flaky, tmp_path / "art").bad == [], "the next run reads it"


def test_an_access_error_is_not_retried_and_not_cached(flaky, tmp_path) -> None:
    FlakyFileSystem.failures, FlakyFileSystem.error = {"/imgs/cat/0.png": 1}, PermissionError
    with pytest.raises(ImageReadError, match=r"cat/0\.png.*credentials, permissions"):
        _format(flaky, tmp_path / "art")
    assert not (tmp_path / "art").exists()
