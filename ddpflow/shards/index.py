"""A split's shard index: the JSON file that lists its shards, in order, and their records.

Sample i of the split is record i - start(s) of the shard s whose range holds i, shards in
the order listed. The shards are in the folder `shards/` next to the index (a relative
place, so a store copied or mounted elsewhere still reads). The index is written after its
shards, last, so an index that exists lists shards that were complete; readers check each
shard against it (shard_file).

An index is data from the store, which someone else may have written: `read_index` checks
every field against what the writer makes before anything is sized from it (names of the
writer's form, so no path leaves the shards folder; shapes and counts that agree with the
listed bytes; caps per shard and per split), and a stream compares the listed sizes with
the stored ones before it plans an epoch (`check_stored_sizes`). A forged index is a
ShardError naming the index and the field, never memory allocated on its word.

The index names the split's encoding (ddpflow.shards.encoding) when it is not raw:
`"encoding": {"kind": "jpeg", "quality": 90}`. An index without the field is raw, and a raw
index is written without it, byte for byte as before there was a choice.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddpflow import storage
from ddpflow.shards.encoding import KINDS, RAW, ShardEncoding
from ddpflow.shards.records import LABEL_BYTES, min_shard_bytes
from ddpflow.shards.shard_file import REFORMAT_HINT, ShardError, ShardInfo, write_shard
from ddpflow.storage.redact import redact_url

INDEX_SUFFIX = ".shards.json"
INDEX_VERSION = 1
# An index lists one entry per shard (about 100 bytes): 64 MiB is over half a million shards.
INDEX_MAX_BYTES = 64 * 2**20
SHARDS_FOLDER = "shards"
# The writer names a shard by the first 32 hex digits of its content's SHA-256.
SHARD_NAME = re.compile(r"[0-9a-f]{32}\.shard")
# The writer's largest shard: 4096 MiB of records (the flows' shard_mb limit) and their labels.
MAX_SHARD_BYTES = 2**33
MAX_RECORD_DIMS = 4
# An epoch's order holds 8 bytes per sample on every rank: 2 GiB at this many samples.
MAX_SPLIT_SAMPLES = 2**28


@dataclass(frozen=True)
class ShardIndex:
    """The shards of one split, where they are, and the shape of one record."""

    folder: str  # where the shards are: SHARDS_FOLDER next to the index
    record_shape: tuple[int, ...]
    shards: tuple[ShardInfo, ...]
    labeled: bool = True  # False: records alone (their targets are part of them)
    # How each shard holds its records; record_shape is a record's shape once decoded.
    encoding: ShardEncoding = RAW

    def __len__(self) -> int:
        return sum(s.count for s in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def uri(self, shard: ShardInfo) -> str:
        return storage.join(self.folder, shard.name)

    def to_json(self) -> bytes:
        data: dict[str, Any] = {
            "version": INDEX_VERSION,
            "record_shape": list(self.record_shape),
            "labeled": self.labeled,
        }
        if not self.encoding.raw:  # a raw index stays what it was before encodings
            data["encoding"] = self.encoding.to_dict()
        data["shards"] = [s.to_dict() for s in self.shards]
        return json.dumps(data).encode()


def is_index_uri(uri: str) -> bool:
    return uri.endswith(INDEX_SUFFIX)


def shards_folder(index_uri: str) -> str:
    """Where the shards of the index at `index_uri` are: `shards/` beside it."""
    parent = index_uri.rsplit("/", 1)[0] if "/" in index_uri else "."
    return storage.join(parent, SHARDS_FOLDER)


def write_index(
    uri: str,
    record_shape: tuple[int, ...],
    shards: tuple[ShardInfo, ...],
    labeled: bool = True,
    encoding: ShardEncoding = RAW,
) -> ShardIndex:
    """Write the index of `shards` (written already, in shards_folder(uri), in `encoding`)
    at `uri`."""
    index = ShardIndex(shards_folder(uri), tuple(record_shape), tuple(shards), labeled, encoding)
    storage.write_bytes(uri, index.to_json())
    return index


def read_index(uri: str) -> ShardIndex:
    """The index at `uri`; ValueError naming it when it is not one this version reads."""
    data = json.loads(
        storage.read_bytes(uri, INDEX_MAX_BYTES, "pass the URI of a split's .shards.json index")
    )
    if not isinstance(data, dict) or data.get("version") != INDEX_VERSION:
        found = data.get("version") if isinstance(data, dict) else None
        raise ValueError(
            f"{uri} is a shard index of version {found!r}, not "
            f"{INDEX_VERSION}: format the data again with this ddpflow"
        )
    return _checked(data, uri)


def _refuse(uri: str, field: str, problem: str) -> ShardError:
    return ShardError(
        f"shard index {redact_url(uri)}: {field} {problem}; it is not what ddpflow's "
        f"formatting writes. {REFORMAT_HINT}"
    )


def _count(value: Any, uri: str, field: str, low: int, high: int) -> int:
    """An int (not a bool, not a float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _refuse(uri, field, f"is {value!r}, not a whole number in [{low}, {high}]")
    return value


def _checked(data: dict, uri: str) -> ShardIndex:
    """The index in `data`, every field checked against what the writer makes."""
    shape = data.get("record_shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RECORD_DIMS:
        raise _refuse(uri, "record_shape", f"is {shape!r}, not 1 to {MAX_RECORD_DIMS} sizes")
    record_shape = tuple(
        _count(d, uri, f"record_shape[{i}]", 1, MAX_SHARD_BYTES) for i, d in enumerate(shape)
    )
    labeled = data.get("labeled", True)
    if not isinstance(labeled, bool):
        raise _refuse(uri, "labeled", f"is {labeled!r}, not true or false")
    per_record = math.prod(record_shape) + (LABEL_BYTES if labeled else 0)
    if per_record > MAX_SHARD_BYTES:
        raise _refuse(uri, "record_shape", f"makes records of {per_record} bytes")
    encoding = _encoding(data.get("encoding"), uri, record_shape)
    entries = data.get("shards")
    if not isinstance(entries, list):
        raise _refuse(uri, "shards", "is not a list")
    shards, total = [], 0
    for i, entry in enumerate(entries):
        field = f"shards[{i}]"
        if not isinstance(entry, dict):
            raise _refuse(uri, field, "is not an object")
        name = entry.get("name")
        if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
            raise _refuse(uri, f"{field}.name", f"{name!r} is not a shard name (32 hex digits)")
        count = _count(entry.get("count"), uri, f"{field}.count", 1, MAX_SPLIT_SAMPLES)
        nbytes = _count(entry.get("nbytes"), uri, f"{field}.nbytes", 1, MAX_SHARD_BYTES)
        if encoding.raw and count * per_record != nbytes:
            raise _refuse(
                uri, f"{field}.nbytes", f"is {nbytes}, not {count} records of {per_record} bytes"
            )
        if not encoding.raw and nbytes < min_shard_bytes(count, labeled):
            # Encoded records vary in size, but each takes a byte and its table entries: the
            # counts that size a stream's order stay tied to stored bytes.
            raise _refuse(
                uri, f"{field}.nbytes", f"is {nbytes}, too few for {count} encoded records"
            )
        crc32 = _count(entry.get("crc32"), uri, f"{field}.crc32", 0, 2**32 - 1)
        total += count
        if total > MAX_SPLIT_SAMPLES:
            raise _refuse(uri, "shards", f"list over {MAX_SPLIT_SAMPLES} samples")
        shards.append(ShardInfo(name, count, nbytes, crc32))
    return ShardIndex(shards_folder(uri), record_shape, tuple(shards), labeled, encoding)


def _encoding(value: Any, uri: str, record_shape: tuple[int, ...]) -> ShardEncoding:
    """The index's encoding field checked (absent: raw, as indexes before encodings)."""
    if value is None:
        return RAW
    if not isinstance(value, dict) or value.get("kind") not in KINDS:
        raise _refuse(uri, "encoding", f"is {value!r:.80}, not one of {', '.join(KINDS)}")
    try:
        encoding = ShardEncoding(value["kind"], value.get("quality", RAW.quality))
    except ValueError as error:
        raise _refuse(uri, "encoding", str(error)) from None
    if encoding.kind == "jpeg" and (len(record_shape) != 3 or record_shape[0] != 3):
        raise _refuse(uri, "record_shape", f"is {list(record_shape)}, not an RGB image's [3, H, W]")
    return encoding


def check_stored_sizes(index: ShardIndex) -> None:
    """ShardError unless every shard the index lists is stored with the size it lists (one
    listing of the shards folder): counts that grow memory are checked against real bytes."""
    fs, path = storage.url_to_fs(index.folder)
    try:
        listed = fs.ls(path, detail=True, refresh=True)  # not a listing cached before a write
    except FileNotFoundError:
        listed = []
    sizes = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry.get("size") for entry in listed}
    for shard in index.shards:
        stored = sizes.get(shard.name)
        if stored is None:
            raise ShardError(
                f"shard {redact_url(index.uri(shard))} is missing: it was deleted after "
                f"formatting. {REFORMAT_HINT}"
            )
        if stored != shard.nbytes:
            raise ShardError(
                f"shard {redact_url(index.uri(shard))} has {stored} bytes, but the index lists "
                f"{shard.nbytes}: the shard or the index was replaced after formatting. "
                f"{REFORMAT_HINT}"
            )


def write_records(
    uri: str,
    records: np.ndarray,
    labels: Sequence[int] | None,
    per_shard: int,
    encoding: ShardEncoding = RAW,
) -> ShardIndex:
    """`records` (uint8 [n, ...]; for jpeg, images [n, 3, H, W]) and their labels (None:
    records alone) as shards of `per_shard` records in `encoding`, in order, then their
    index at `uri` (last): a split ready to stream."""
    if per_shard < 1:
        raise ValueError(f"per_shard={per_shard} must be >= 1 record")
    folder = shards_folder(uri)
    shards = tuple(
        write_shard(
            folder,
            records[lo : lo + per_shard],
            None if labels is None else labels[lo : lo + per_shard],
            encoding,
        )
        for lo in range(0, len(records), per_shard)
    )
    return write_index(uri, tuple(records.shape[1:]), shards, labels is not None, encoding)


def shards_present(*index_uris: str) -> bool:
    """Whether every shard the indexes at `index_uris` list is in its folder (one listing
    per folder): a format that lost one is formatted again, which rewrites it."""
    listed: dict[str, set[str]] = {}
    for uri in index_uris:
        index = read_index(uri)
        if index.folder not in listed:
            listed[index.folder] = set(storage.list_names(index.folder))
        if any(shard.name not in listed[index.folder] for shard in index.shards):
            return False
    return True
