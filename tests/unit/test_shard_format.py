"""Formatting an image folder into shards (ddpflow.workloads.vision.shard_format), in one
process: content-defined chunks, reuse, and a deleted shard written again."""

from __future__ import annotations

import os

import pytest

from ddpflow.shards.index import read_index
from ddpflow.workloads.vision.data import ImageSpec, open_split
from ddpflow.workloads.vision.image_folder import DatasetError
from ddpflow.workloads.vision.shard_format import format_shards, plan_shards, reusable
from tests.helpers.pngs import png

SPEC = ImageSpec(8)
RECORD_MB = 3 * 8 * 8 / 2**20


def _folder(root, per_class: int = 60):
    for label in ("dark", "light"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            grey = (20 if label == "dark" else 200) + i % 30
            (root / label / f"{i:03d}.png").write_bytes(png(grey, (8, 8)))
    return str(root)


def _plan(folder: str, store: str):  # noqa: ANN202
    # About 10 images a shard: several chunks from a small folder.
    return plan_shards(folder, store, SPEC, 0.2, 0, 20, shard_mb=10 * RECORD_MB)


def test_each_image_is_in_one_shard_and_the_splits_read_back(tmp_path):
    folder = _folder(tmp_path / "images")
    plan = _plan(folder, str(tmp_path / "store"))
    assert all(5 <= len(c.keys) <= 20 for c in plan.chunks[:-1])
    data = format_shards(plan, 0.0)
    assert (data.num_train, data.num_val) == (96, 24)
    keys = [k for c in plan.chunks for k in c.keys]
    assert len(keys) == len(set(keys)) == 120
    train = open_split(data.train_uri)
    import torch

    images, labels = train.batch(torch.arange(len(train)))
    # A dark image is darker than any light one: each label travelled with its image.
    means = images.float().mean(dim=(1, 2, 3))
    assert means[labels == 0].max() < means[labels == 1].min()


def test_an_added_file_changes_only_the_chunk_it_falls_in(tmp_path):
    folder = _folder(tmp_path / "images")
    before = {c.key for c in _plan(folder, str(tmp_path / "store")).chunks}
    (tmp_path / "images" / "dark" / "new.png").write_bytes(png(25, (8, 8)))
    after = {c.key for c in _plan(folder, str(tmp_path / "store")).chunks}
    assert 1 <= len(after - before) <= 2, "the new file's chunk (and a moved cut point)"
    assert len(before & after) >= len(before) - 2


def test_a_deleted_shard_is_written_again_by_the_next_format(tmp_path):
    folder = _folder(tmp_path / "images")
    plan = _plan(folder, str(tmp_path / "store"))
    data = format_shards(plan, 0.0)
    assert reusable(plan) is not None
    index = read_index(data.train_uri)
    victim = index.uri(index.shards[1])
    os.remove(victim)
    assert reusable(plan) is None, "a format missing a shard is not reused"
    again = format_shards(_plan(folder, str(tmp_path / "store")), 0.0)
    assert os.path.exists(victim) and again.train_uri == data.train_uri


def test_a_folder_whose_images_are_all_unreadable_fails_naming_it(tmp_path):
    root = tmp_path / "broken"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            (root / label / f"{i}.png").write_bytes(b"\x89PNG not an image")
    with pytest.raises(DatasetError, match=str(root)):
        format_shards(_plan(str(root), str(tmp_path / "store")), 1.0 - 1e-9)
