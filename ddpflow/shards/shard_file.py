"""One shard: uint8 records and their int64 labels, named by their content digest.

A raw shard (the default encoding) is the records (count x record bytes) followed by the
labels (count x 8 bytes, little-endian), or the records alone for data whose targets are in
the record (the char-LM's windows; the index says which): a reader slices it with numpy, no
parsing, no per-sample objects. A jpeg shard holds each image record compressed on its own,
variable in length (ddpflow.shards.records: the records, an offsets table, the labels); the
index names the encoding (ddpflow.shards.encoding), and the rank decodes the records its
batches take (ddpflow.shards.decoding). Either way its length
and CRC-32 are kept in the index, so a truncated or rewritten shard is caught when it is read,
before any of its samples reaches a training step. The name is the SHA-256 of the content, so
the same records write the same shard on any worker, and a shard is never overwritten by
different bytes.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ddpflow import storage
from ddpflow.shards.encoding import RAW, ShardEncoding
from ddpflow.shards.records import LABEL_BYTES, EncodedRecords, pack_records, unpack_records
from ddpflow.shards.settings import DEFAULT_READ_BOUND_S
from ddpflow.storage.redact import redact_url
from ddpflow.storage.retry import OutageTooLong, retry_for

SUFFIX = ".shard"
T = TypeVar("T")
# Memory a shard is read into: 1-D uint8, made with np.empty, so that its pages become
# memory as bytes are written into them, not when it is made.
Buffer = np.ndarray
# A shard's records as a reader gets them: uint8 [count, *record_shape] for a raw shard, the
# encoded records of a compressed one.
Records = np.ndarray | EncodedRecords


class ShardError(RuntimeError):
    """A shard cannot be used: the message names it and the fix."""


@dataclass(frozen=True)
class ShardInfo:
    """What the index keeps of a shard: enough to find it and to check it whole."""

    name: str
    count: int
    nbytes: int
    crc32: int

    def to_dict(self) -> dict[str, int | str]:
        return {"name": self.name, "count": self.count, "nbytes": self.nbytes, "crc32": self.crc32}

    @classmethod
    def from_dict(cls, data: dict) -> ShardInfo:
        return cls(str(data["name"]), int(data["count"]), int(data["nbytes"]), int(data["crc32"]))


def encode_shard(
    records: np.ndarray, labels: Sequence[int] | None = None, encoding: ShardEncoding = RAW
) -> tuple[ShardInfo, bytes]:
    """(info, bytes) of a shard holding `records` (uint8 [n, ...]; for jpeg, images
    [n, 3, H, W]) and their labels, if any, in `encoding`."""
    if records.dtype != np.uint8:
        raise ValueError(f"shard records must be uint8, got {records.dtype}")
    if labels is not None and len(records) != len(labels):
        raise ValueError(f"{len(records)} records but {len(labels)} labels")
    if encoding.raw:
        data = np.ascontiguousarray(records).tobytes()
        if labels is not None:
            data += np.asarray(labels, "<i8").tobytes()
    else:
        from ddpflow.shards.jpeg import encode_images  # torch: on the worker that formats

        data = pack_records(encode_images(records, encoding.quality), labels)
    name = hashlib.sha256(data).hexdigest()[:32] + SUFFIX
    return ShardInfo(name, len(records), len(data), zlib.crc32(data)), data


def decode_shard(
    data: bytes | memoryview,
    info: ShardInfo,
    record_shape: tuple[int, ...],
    shown: str,
    labeled: bool = True,
    encoding: ShardEncoding = RAW,
) -> tuple[Records, np.ndarray | None]:
    """(records, labels [count] int64 or None), views of `data`: raw records as uint8
    [count, *record_shape], others as their encoded bytes (the rank decodes those a batch
    takes); ShardError naming `shown` when the bytes are not the shard the index lists."""
    if len(data) != info.nbytes:
        raise ShardError(
            f"shard {shown} has {len(data)} bytes, but the index lists {info.nbytes}: it was "
            f"truncated or replaced after formatting. {REFORMAT_HINT}"
        )
    if zlib.crc32(data) != info.crc32:
        raise ShardError(
            f"shard {shown} does not match its CRC-32 in the index: its bytes changed after "
            f"formatting (a corrupt copy or disk). {REFORMAT_HINT}"
        )
    if not encoding.raw:
        unpacked = unpack_records(data, info.count, labeled)
        if isinstance(unpacked, str):
            raise ShardError(
                f"{encoding.kind} shard {shown} does not hold {info.count} records as the "
                f"index lists: {unpacked}. {REFORMAT_HINT}"
            )
        return unpacked
    record_bytes = math.prod(record_shape)
    if info.count * (record_bytes + (LABEL_BYTES if labeled else 0)) != info.nbytes:
        raise ShardError(
            f"shard {shown} holds {info.count} records of {record_shape} by the index, which "
            f"is not its {info.nbytes} bytes: the index belongs to another format. "
            f"{REFORMAT_HINT}"
        )
    cut = info.count * record_bytes
    records = np.frombuffer(data, np.uint8, cut).reshape(info.count, *record_shape)
    labels = np.frombuffer(data, "<i8", info.count, offset=cut) if labeled else None
    return records, labels


# What a user does about a missing or damaged shard: the format step checks every shard an
# index lists and rewrites the ones that are missing, so running it again is the fix.
REFORMAT_HINT = (
    "Run the flow again: its format step checks the shards and rewrites missing ones; "
    "delete a damaged shard first so that it is rewritten"
)


def read_shard(
    uri: str,
    info: ShardInfo,
    record_shape: tuple[int, ...],
    bound_s: float = DEFAULT_READ_BOUND_S,
    on_wait: Callable[[], None] | None = None,
    buffer: Buffer | Callable[[int], Buffer] | None = None,
    labeled: bool = True,
    encoding: ShardEncoding = RAW,
) -> tuple[Records, np.ndarray | None]:
    """Read and check one shard, retrying a store that does not answer for `bound_s`.

    `buffer` (at least info.nbytes), or a function that gives one of a size, called only
    once the file is found to have the listed size: a local shard is read into it rather
    than into new memory, and the arrays returned are views of it. A stream hands in the
    buffers of the shards it dropped, so a rank's memory is the shards it holds, not what the
    allocator kept of every shard read before (measured: 42 MiB of data memory at 1x data,
    50 at 4x, with a new allocation per read; the same at both with reused buffers)."""
    shown = redact_url(uri)
    fs, path = storage.url_to_fs(uri)

    def read() -> bytes | memoryview:
        if isinstance(fs, LocalFileSystem):
            return _read_local(path, info, shown, buffer)
        # One ranged GET of at most one byte more than the index lists (a shard replaced
        # by a larger object is cut off there and fails its size check): measured on moto,
        # 150-170 MiB/s against 90 for the capped reader's stat, open and 1 MiB reads.
        return fs.cat_file(path, start=0, end=info.nbytes + 1)

    data = read_retried(read, f"reading shard {uri}", shown, bound_s, on_wait)
    return decode_shard(data, info, record_shape, shown, labeled, encoding)


def read_retried(
    read: Callable[[], T],
    what: str,
    shown: str,
    bound_s: float,
    on_wait: Callable[[], None] | None,
) -> T:
    """`read()` retried while the store does not answer, for `bound_s`; ShardError naming
    the shard (`shown`, its redacted URI) when it is missing or the bound runs out. The one
    way every read of a shard (whole, or a range of it) meets the store."""
    try:
        return retry_for(
            read,
            what=what,
            bound_s=bound_s,
            hint="the store is unreachable; training resumes from its last checkpoint once "
            "it answers (a restart), or raise the shard read bound",
            on_wait=on_wait,
        )
    except FileNotFoundError as error:
        raise ShardError(
            f"shard {shown} is missing: it was deleted after formatting. {REFORMAT_HINT}"
        ) from error
    except OutageTooLong as error:
        raise ShardError(f"shard {shown} could not be read: {error}") from error


def _read_local(
    path: str, info: ShardInfo, shown: str, buffer: Buffer | Callable[[int], Buffer] | None
) -> bytes | memoryview:
    """The local shard's bytes, into `buffer` when given; a shard that is not a regular
    file of the listed size is refused before a byte is read."""
    status = os.stat(path)  # FileNotFoundError: deleted since formatting
    if not stat.S_ISREG(status.st_mode):
        raise ShardError(f"shard {shown} is not a regular file. {REFORMAT_HINT}")
    if status.st_size != info.nbytes:
        raise ShardError(
            f"shard {shown} has {status.st_size} bytes, but the index lists {info.nbytes}: "
            f"it was truncated or replaced after formatting. {REFORMAT_HINT}"
        )
    if callable(buffer):  # sized now that the file is known to hold what the index lists
        buffer = buffer(info.nbytes)
    target = buffer if buffer is not None and len(buffer) >= info.nbytes else None
    view = (target if target is not None else np.empty(info.nbytes, np.uint8)).data[: info.nbytes]
    with open(path, "rb") as file:
        got = file.readinto(view)
    if got != info.nbytes:
        raise ShardError(
            f"shard {shown} ended after {got} of its {info.nbytes} bytes while it was read: "
            f"it is being rewritten or was truncated. {REFORMAT_HINT}"
        )
    return view


def write_shard(
    folder: str,
    records: np.ndarray,
    labels: Sequence[int] | None = None,
    encoding: ShardEncoding = RAW,
) -> ShardInfo:
    """Write the shard of `records` and `labels` (None: records alone) in `encoding` into
    `folder` (atomically, storage.write_bytes) unless a shard of the same content is there
    already; its info for the index."""
    info, data = encode_shard(records, labels, encoding)
    uri = storage.join(folder, info.name)
    fs, path = storage.url_to_fs(uri)
    try:
        present = fs.size(path) == info.nbytes  # one request: the same name is the same bytes
    except FileNotFoundError:
        present = False
    if not present:
        storage.write_bytes(uri, data)
    return info
