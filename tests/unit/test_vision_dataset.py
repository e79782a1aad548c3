"""The per-item Dataset path: same tensors as formatting, loader workers spawned not forked."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from ddpflow.vision.data import ImageSpec
from ddpflow.vision.dataset import ImageFolderDataset, spawn_loader
from ddpflow.vision.image_folder import DatasetError, list_image_folder


def _folder(root: Path) -> Path:
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            buffer = io.BytesIO()
            Image.new("RGB", (10, 6), (40 * i, 100, 200)).save(buffer, format="PNG")
            (root / label / f"{i}.png").write_bytes(buffer.getvalue())
    return root


def test_items_are_transformed_images_with_their_class(tmp_path: Path) -> None:
    index = list_image_folder(str(_folder(tmp_path / "f")))
    dataset = ImageFolderDataset(index, ImageSpec(8).transform(), indices=[0, 4])
    assert len(dataset) == 2
    image, label = dataset[1]
    assert image.shape == (3, 8, 8) and image.dtype == torch.uint8 and label == 1
    images, labels = next(iter(spawn_loader(dataset, batch_size=2)))
    assert images.shape == (2, 3, 8, 8) and labels.tolist() == [0, 1]


def test_an_unreadable_item_names_its_uri(tmp_path: Path) -> None:
    root = _folder(tmp_path / "f")
    (root / "b" / "0.png").write_bytes(b"garbage")
    dataset = ImageFolderDataset(list_image_folder(str(root)), ImageSpec(8).transform())
    with pytest.raises(DatasetError, match=r"cannot read .*b/0\.png"):
        dataset[3]


@pytest.mark.timeout(120)
def test_loader_workers_use_the_spawn_context(tmp_path: Path) -> None:
    index = list_image_folder(str(_folder(tmp_path / "f")))
    dataset = ImageFolderDataset(index, ImageSpec(8).transform())
    loader = spawn_loader(dataset, batch_size=3, num_workers=1)
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    started = time.monotonic()
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert time.monotonic() - started < 100
