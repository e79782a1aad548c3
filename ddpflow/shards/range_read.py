"""One byte range of a shard in an object store: where the ranges of a shard are, and one
ranged GET of them, checked and retried within the shard read bound.

A rank reads a shard from S3 as several ranges at once (ddpflow.shards.parallel_reads): a
range is its own GET, so it fails, comes back short and is retried on its own; the shard
is checked whole (length and CRC-32, shard_file.decode_shard) once all its ranges are in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from ddpflow import storage
from ddpflow.shards.shard_file import REFORMAT_HINT, ShardError, ShardInfo, read_retried
from ddpflow.storage.redact import redact_url


@dataclass(frozen=True)
class ShardRange:
    """Bytes [start, end) of shard number `shard` (its place in the index)."""

    shard: int
    start: int
    end: int
    last: bool  # the shard's last range: asked for one byte more (see read_range)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def shard_ranges(
    shards: Sequence[ShardInfo], order: Iterable[int], chunk: int
) -> Iterator[ShardRange]:
    """The ranges of chunk bytes (the last of a shard shorter) of each shard in `order`, in
    that order: the bytes of the first shard needed first, then the next. (Made as they are
    asked for: an epoch's list would grow with the dataset.)"""
    for s in order:
        nbytes = shards[s].nbytes
        for start in range(0, nbytes, chunk):
            end = min(start + chunk, nbytes)
            yield ShardRange(s, start, end, end == nbytes)


def range_fs(uri: str, connections: int) -> tuple[fsspec.AbstractFileSystem, str]:
    """storage.url_to_fs, with room for `connections` requests at once on S3: botocore's
    pool holds 10 connections, and a request past them waits for one, so 16 ranges in
    flight would run 10 at a time. (A filesystem of its own, fsspec caching it by these
    options: the stream's requests do not queue behind the rank's uploads either.)"""
    if not uri.startswith(("s3://", "s3a://")):
        return storage.url_to_fs(uri)
    options: dict[str, Any] = storage.s3_options()
    config = {**options.get("config_kwargs", {}), "max_pool_connections": connections}
    return fsspec.core.url_to_fs(uri, **{**options, "config_kwargs": config})


class ShortRange(OSError):
    """A range came back with fewer bytes than asked while the object still has the listed
    size: a response cut short, worth another try (an OSError, so retry_for retries it)."""


def read_range(
    uri: str,
    info: ShardInfo,
    part: ShardRange,
    bound_s: float,
    connections: int,
    on_wait: Callable[[], None] | None = None,
) -> bytes:
    """The bytes of `part` of the shard at `uri` (through range_fs(uri, connections)),
    retrying a store that does not answer and a range that comes back short for `bound_s`
    (`on_wait` runs before each pause: what it raises ends the retries); ShardError naming
    the shard when it is missing, has another size than the index lists, or cannot be
    read."""
    shown = redact_url(uri)
    fs, path = range_fs(uri, connections)

    def read() -> bytes:
        # The last range asks for one byte past the listed end: a shard replaced by a larger
        # object gives that byte and fails at once, as a whole-shard read does.
        end = part.end + 1 if part.last else part.end
        data = fs.cat_file(path, start=part.start, end=end)
        if len(data) > part.nbytes:
            raise ShardError(
                f"shard {shown} has more bytes than the {info.nbytes} the index lists: it was "
                f"replaced after formatting. {REFORMAT_HINT}"
            )
        if len(data) < part.nbytes:
            fs.invalidate_cache(path)
            stored = fs.size(path)  # short because the object shrank: no retry mends that
            if stored != info.nbytes:
                raise ShardError(
                    f"shard {shown} has {stored} bytes, but the index lists {info.nbytes}: it "
                    f"was truncated or replaced after formatting. {REFORMAT_HINT}"
                )
            raise ShortRange(
                f"bytes {part.start}-{part.end} of shard {shown} came back as {len(data)} bytes"
            )
        return data

    what = f"reading bytes {part.start}-{part.end} of shard {uri}"
    return read_retried(read, what, shown, bound_s, on_wait)
