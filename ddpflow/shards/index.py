"""A split's shard index: the JSON file that lists its shards, in order, and their records.

Sample i of the split is record i - start(s) of the shard s whose range holds i, shards in
the order listed. The shards are in the folder `shards/` next to the index (a relative
place, so a store copied or mounted elsewhere still reads). The index is written after its
shards, last, so an index that exists lists shards that were complete; readers check each
shard against it (shard_file).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddpflow import storage
from ddpflow.shards.shard_file import ShardInfo, write_shard

INDEX_SUFFIX = ".shards.json"
INDEX_VERSION = 1
# An index lists one entry per shard (about 100 bytes): 64 MiB is over half a million shards.
INDEX_MAX_BYTES = 64 * 2**20
SHARDS_FOLDER = "shards"


@dataclass(frozen=True)
class ShardIndex:
    """The shards of one split, where they are, and the shape of one record."""

    folder: str  # where the shards are: SHARDS_FOLDER next to the index
    record_shape: tuple[int, ...]
    shards: tuple[ShardInfo, ...]
    labeled: bool = True  # False: records alone (their targets are part of them)

    def __len__(self) -> int:
        return sum(s.count for s in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def uri(self, shard: ShardInfo) -> str:
        return storage.join(self.folder, shard.name)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": INDEX_VERSION,
                "record_shape": list(self.record_shape),
                "labeled": self.labeled,
                "shards": [s.to_dict() for s in self.shards],
            }
        ).encode()


def is_index_uri(uri: str) -> bool:
    return uri.endswith(INDEX_SUFFIX)


def shards_folder(index_uri: str) -> str:
    """Where the shards of the index at `index_uri` are: `shards/` beside it."""
    parent = index_uri.rsplit("/", 1)[0] if "/" in index_uri else "."
    return storage.join(parent, SHARDS_FOLDER)


def write_index(
    uri: str, record_shape: tuple[int, ...], shards: tuple[ShardInfo, ...], labeled: bool = True
) -> ShardIndex:
    """Write the index of `shards` (written already, in shards_folder(uri)) at `uri`."""
    index = ShardIndex(shards_folder(uri), tuple(record_shape), tuple(shards), labeled)
    storage.write_bytes(uri, index.to_json())
    return index


def read_index(uri: str) -> ShardIndex:
    """The index at `uri`; ValueError naming it when it is not one this version reads."""
    data = json.loads(
        storage.read_bytes(uri, INDEX_MAX_BYTES, "pass the URI of a split's .shards.json index")
    )
    if data.get("version") != INDEX_VERSION:
        raise ValueError(
            f"{uri} is a shard index of version {data.get('version')!r}, not "
            f"{INDEX_VERSION}: format the data again with this ddpflow"
        )
    shards = tuple(ShardInfo.from_dict(s) for s in data["shards"])
    return ShardIndex(
        shards_folder(uri), tuple(data["record_shape"]), shards, bool(data.get("labeled", True))
    )


def write_records(
    uri: str, records: np.ndarray, labels: Sequence[int] | None, per_shard: int
) -> ShardIndex:
    """`records` (uint8 [n, ...]) and their labels (None: records alone) as shards of
    `per_shard` records, in order, then their index at `uri` (last): a split ready to
    stream."""
    if per_shard < 1:
        raise ValueError(f"per_shard={per_shard} must be >= 1 record")
    folder = shards_folder(uri)
    shards = tuple(
        write_shard(
            folder,
            records[lo : lo + per_shard],
            None if labels is None else labels[lo : lo + per_shard],
        )
        for lo in range(0, len(records), per_shard)
    )
    return write_index(uri, tuple(records.shape[1:]), shards, labels is not None)


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
