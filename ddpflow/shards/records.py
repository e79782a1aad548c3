"""Variable-length records in one shard: what a compressed (jpeg) shard holds.

The layout is the records' encoded bytes, one after another, then an offsets table of
count + 1 little-endian int64 (record i is bytes offsets[i]:offsets[i + 1]; offsets[0] is 0,
the last is the length of the encoded bytes), then the labels (count little-endian int64),
or no labels for records whose targets are in the record. The table at the end means a
writer streams the records out before it knows their sizes; a reader finds the table from
the shard's length and the count the index lists, so a shard stays one blob checked whole
(length, CRC-32, name) like a raw one (ddpflow.shards.shard_file). Free of torch: the
format step's module imports it in the flow process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

OFFSET_BYTES = 8
LABEL_BYTES = 8


def pack_records(encoded: Sequence[bytes], labels: Sequence[int] | None) -> bytes:
    """The shard bytes of `encoded` records (each at least one byte) and their labels."""
    if any(len(e) == 0 for e in encoded):
        raise ValueError("an encoded record is empty: an encoder returned no bytes")
    if labels is not None and len(labels) != len(encoded):
        raise ValueError(f"{len(encoded)} records but {len(labels)} labels")
    offsets = np.zeros(len(encoded) + 1, "<i8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    tail = offsets.tobytes() + (b"" if labels is None else np.asarray(labels, "<i8").tobytes())
    return b"".join(encoded) + tail


def table_bytes(count: int, labeled: bool) -> int:
    """The bytes after the records: the offsets table and the labels."""
    return (count + 1) * OFFSET_BYTES + (count * LABEL_BYTES if labeled else 0)


def min_shard_bytes(count: int, labeled: bool) -> int:
    """The fewest bytes a shard of `count` records can have (a record is at least a byte)."""
    return count + table_bytes(count, labeled)


@dataclass(frozen=True)
class EncodedRecords:
    """A shard's encoded records: views of its bytes, and where each record is in them."""

    payload: np.ndarray  # uint8: the records' bytes, one after another
    offsets: np.ndarray  # int64 [count + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def take(self, rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Copies of the records at `rows` (copies: the shard's buffer is reused once the
        shard is dropped, and a decode may still be running then)."""
        offsets = self.offsets
        return [self.payload[offsets[r] : offsets[r + 1]].copy() for r in np.asarray(rows)]


def unpack_records(
    data: bytes | memoryview, count: int, labeled: bool
) -> tuple[EncodedRecords, np.ndarray | None] | str:
    """(records, labels or None), views of `data`; or what is wrong with the offsets table,
    in words, for the caller's error naming the shard."""
    tail = table_bytes(count, labeled)
    if len(data) < count + tail:
        return f"its {len(data)} bytes cannot hold {count} records and their table"
    end = len(data) - tail
    offsets = np.frombuffer(data, "<i8", count + 1, offset=end)
    sizes = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != end or (sizes < 1).any():
        bad = int(np.flatnonzero(sizes < 1)[0]) if (sizes < 1).any() else None
        where = f" (record {bad} is empty or runs backwards)" if bad is not None else ""
        return (
            f"its offsets table does not cover its {end} bytes of records from 0 to the end{where}"
        )
    payload = np.frombuffer(data, np.uint8, end)
    labels = (
        np.frombuffer(data, "<i8", count, offset=end + (count + 1) * OFFSET_BYTES)
        if labeled
        else None
    )
    return EncodedRecords(payload, offsets), labels
