"""A shard index is data someone else may have written: every field is checked against what
the writer makes before a rank sizes anything from it (ddpflow.shards.index)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import psutil
import pytest

from ddpflow.shards.index import MAX_SPLIT_SAMPLES, read_index, write_records
from ddpflow.shards.shard_file import ShardError
from ddpflow.shards.stream import ShardStream

SHAPE = (3, 4, 4)
RECORD = 3 * 4 * 4 + 8  # bytes of one labeled record
GROWTH_ALLOWED = 32 * 2**20


def _index(tmp_path: Path) -> tuple[str, dict]:
    """A real split of 3 shards; its index as JSON, to tamper with."""
    uri = str(tmp_path / "train.shards.json")
    records = np.zeros((12, *SHAPE), np.uint8)
    write_records(uri, records, list(range(12)), 4)
    return uri, json.loads(Path(uri).read_text())


def _tampered(uri: str, data: dict) -> str:
    Path(uri).write_text(json.dumps(data))
    return uri


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("name", "../../../etc/passwd", "shards[1].name"),
        ("name", "0123456789abcdef0123456789abcdef.shard/../x", "shards[1].name"),
        ("name", "/abs/0123456789abcdef0123456789abcdef.shard", "shards[1].name"),
        ("nbytes", 768 * 2**20, "shards[1].nbytes"),
        ("nbytes", 2**40, "shards[1].nbytes"),
        ("count", 2**25, "shards[1].nbytes"),  # more records than the bytes it lists
        ("count", 2**36, "shards[1].count"),
        ("count", 0, "shards[1].count"),
        ("count", -4, "shards[1].count"),
        ("count", "4", "shards[1].count"),
        ("count", True, "shards[1].count"),
        ("crc32", 2**32, "shards[1].crc32"),
        ("crc32", 1.5, "shards[1].crc32"),
    ],
)
def test_a_tampered_shard_entry_is_refused_naming_the_index_and_field(
    tmp_path: Path, field: str, value: object, named: str
) -> None:
    uri, data = _index(tmp_path)
    data["shards"][1][field] = value
    with pytest.raises(ShardError, match=rf"train\.shards\.json: {re.escape(named)}"):
        read_index(_tampered(uri, data))


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("record_shape", [3, 0, 4], "record_shape[1]"),
        ("record_shape", [3, -4, 4], "record_shape[1]"),
        ("record_shape", [], "record_shape"),
        ("record_shape", [2**20, 2**20, 2**20], "record_shape"),
        ("record_shape", "3x4x4", "record_shape"),
        ("labeled", "yes", "labeled"),
        ("shards", {"a": 1}, "shards"),
    ],
)
def test_a_tampered_shape_or_list_is_refused(
    tmp_path: Path, key: str, value: object, named: str
) -> None:
    uri, data = _index(tmp_path)
    data[key] = value
    with pytest.raises(ShardError, match=rf"train\.shards\.json: {re.escape(named)}"):
        read_index(_tampered(uri, data))


def test_a_split_over_the_sample_cap_is_refused(tmp_path: Path) -> None:
    uri, data = _index(tmp_path)
    big = MAX_SPLIT_SAMPLES // 2 + 1
    for entry in data["shards"][:2]:
        entry.update(count=big, nbytes=big * RECORD)
    with pytest.raises(ShardError, match=r"shards list over"):
        read_index(_tampered(uri, data))


def test_a_consistent_but_forged_entry_is_refused_before_memory_is_sized_from_it(
    tmp_path: Path,
) -> None:
    """Counts and bytes that agree with each other, but not with the stored shard: the
    stream compares them with the store before it plans an epoch or takes a buffer."""
    uri, data = _index(tmp_path)
    forged = 2**25  # 2**25 records: 1.8 GiB listed, an epoch order of 256 MiB
    data["shards"][1].update(count=forged, nbytes=forged * RECORD)
    index = read_index(_tampered(uri, data))  # within every cap: only the store can tell
    before = _rss()
    with pytest.raises(ShardError, match=rf"{data['shards'][1]['name']} has \d+ bytes"):
        ShardStream(index).epoch_order(0, 0)
    assert _rss() - before < GROWTH_ALLOWED


def test_a_genuine_index_reads_back_whole(tmp_path: Path) -> None:
    uri, data = _index(tmp_path)
    index = read_index(uri)
    assert [s.count for s in index.shards] == [4, 4, 4]
    assert [s.name for s in index.shards] == [e["name"] for e in data["shards"]]
    assert len(ShardStream(index).epoch_order(0, 0)) == 12
