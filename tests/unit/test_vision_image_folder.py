"""Image folders: listing like torchvision's ImageFolder, bad files, clear errors, formatting."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder

from ddpflow.workloads.vision.data import ImageSpec, format_image_folder, load_split
from ddpflow.workloads.vision.digits import MARKER, digits_pngs, ensure_digits
from ddpflow.workloads.vision.image_folder import DatasetError, list_image_folder
from tests.helpers.pngs import png


def make_folder(root: Path, files: dict[str, bytes]) -> Path:
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    files = {
        "cat/b.png": png(10),
        "cat/a.PNG": png(20),
        "cat/z.png": png(30),
        "cat/sub/a.png": png(40),
        "cat/sub-x/b.jpg": png(50),
        "dog/1.png": png(60),
        "dog/notes.txt": b"not an image",
        "Bird/x.bmp": png(70),
        "README.md": b"top-level files are not samples",
    }
    return make_folder(tmp_path / "images", files)


def test_classes_and_sample_order_match_torchvision(folder: Path) -> None:
    index = list_image_folder(str(folder))
    reference = ImageFolder(str(folder))
    assert index.classes == reference.classes == ["Bird", "cat", "dog"]
    expected = [(str(Path(p).relative_to(folder)), c) for p, c in reference.samples]
    assert index.samples == expected
    assert index.ignored == ["dog/notes.txt"]


def test_fingerprint_changes_when_a_file_does(folder: Path) -> None:
    before = list_image_folder(str(folder)).fingerprint
    assert list_image_folder(str(folder)).fingerprint == before
    (folder / "dog" / "2.png").write_bytes(png(1))
    assert list_image_folder(str(folder)).fingerprint != before


def test_single_class_is_an_error_naming_root_and_class(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "one", {"7/a.png": png(), "7/b.png": png()})
    with pytest.raises(DatasetError, match=r"only one class folder \('7'\).*at least 2") as error:
        list_image_folder(str(root))
    assert str(root) in str(error.value)


def test_empty_class_folder_is_an_error(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "f", {"a/1.png": png(), "b/readme.txt": b"x"})
    (root / "c").mkdir()
    with pytest.raises(DatasetError, match=r"'b', 'c'.* have no image files") as error:
        list_image_folder(str(root))
    assert str(root) in str(error.value)


def test_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no class folders under .*missing"):
        list_image_folder(str(tmp_path / "missing"))


def _format(root: Path, artifacts: Path, max_bad: float = 0.5, size: int = 8):
    return format_image_folder(str(root), str(artifacts), ImageSpec(size), 0.25, 0, max_bad)


def _two_class_files(n: int) -> dict[str, bytes]:
    return {f"{c}/{i}.png": png(10 * i + c) for c in (0, 1) for i in range(n)}


def test_format_stores_uint8_rgb_tensors_split_by_class(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "f", _two_class_files(4))
    result = _format(root, tmp_path / "art")
    train, val = load_split(result.train_uri), load_split(result.val_uri)
    assert train.images.dtype == torch.uint8 and train.images.shape[1:] == (3, 8, 8)
    assert (result.num_train, result.num_val) == (6, 2)
    assert sorted(val.labels.tolist()) == [0, 1]
    assert _format(root, tmp_path / "art").reused


def test_corrupt_file_is_skipped_and_reported_with_its_key(tmp_path: Path) -> None:
    files = {**_two_class_files(10), "1/broken.png": b"\x89PNG garbage", "0/cut.png": png()[:30]}
    root = make_folder(tmp_path / "f", files)
    result = _format(root, tmp_path / "art", max_bad=0.2)
    assert sorted(b["key"] for b in result.bad) == ["0/cut.png", "1/broken.png"]
    assert result.num_train + result.num_val == 20 and result.num_files == 22


def test_too_many_bad_files_fail_naming_the_share_and_keys(tmp_path: Path) -> None:
    files = {**_two_class_files(3), "1/broken.png": b"garbage", "0/bad.jpg": b"garbage"}
    root = make_folder(tmp_path / "f", files)
    with pytest.raises(DatasetError) as error:
        _format(root, tmp_path / "art", max_bad=0.1)
    message = str(error.value)
    assert "2 of 8" in message and "25.0%" in message and "max_bad_fraction=0.1" in message
    assert str(root / "1" / "broken.png") in message and str(root / "0" / "bad.jpg") in message
    assert not (tmp_path / "art").exists(), "nothing is written"


def test_a_class_with_only_bad_files_is_an_error(tmp_path: Path) -> None:
    files = {**{f"0/{i}.png": png(i) for i in range(5)}, "1/broken.png": b"garbage"}
    root = make_folder(tmp_path / "f", files)
    with pytest.raises(DatasetError, match="'1'.* have no readable image"):
        _format(root, tmp_path / "art", max_bad=0.5)


def test_crop_keeps_aspect_and_stretch_fills(tmp_path: Path) -> None:
    image = Image.fromarray(np.tile(np.arange(40, dtype=np.uint8) * 6, (20, 1)))  # 40x20
    for resize, expected in (("crop", (3, 10, 10)), ("stretch", (3, 10, 10))):
        tensor = ImageSpec(10, resize).transform()(image.convert("RGB"))
        assert tuple(tensor.shape) == expected and tensor.dtype == torch.uint8
    cropped = ImageSpec(10, "crop").transform()(image.convert("RGB"))
    stretched = ImageSpec(10, "stretch").transform()(image.convert("RGB"))
    assert cropped[0, 0, 0] > stretched[0, 0, 0], "crop drops the dark left edge"


def test_digits_folder_is_written_once_with_real_images(tmp_path: Path) -> None:
    files = digits_pngs()
    assert len(files) == 1797 and {k.split("/")[0] for k in files} == set("0123456789")
    with Image.open(io.BytesIO(files["0/0000.png"])) as image:
        assert image.size == (8, 8) and image.mode == "L"
    root = str(tmp_path / "digits")
    assert ensure_digits(root).written and (tmp_path / "digits" / MARKER).exists()
    assert not ensure_digits(root).written
    index = list_image_folder(root)
    assert len(index.samples) == 1797 and index.classes == list("0123456789")
