"""A rank's shards from an object store as ranged GETs, several in flight, bytes bounded.

One GET at a time runs at one connection's rate (50-100 MB/s on S3); a GPU step wants
several times that. The stream (ddpflow.shards.stream) hands this reader its epoch: the
shards in the order their batches first need them. The reader cuts them into ranges of
`chunk` bytes (range_read.shard_ranges) and keeps up to `requests` of them in flight, the
next batches' bytes first, each range copied into its shard's buffer as it lands; a shard
whose ranges are all in is checked whole (length, CRC-32) and handed to the stream.

What it holds beyond the shards the batches in use need is bounded by `max_bytes`: the
bytes of the ranges in flight plus those arrived for shards no batch in use needs yet. A
range is asked for only while that sum stays within the bound, so memory does not grow with
the dataset. It cannot block a batch: ranges go out in the order of first need, so when a
batch waits for a shard, every byte counted ahead belongs to shards needed no later, which
that batch's position already makes due (and so not counted), and in-flight bytes drain.

Requests run on a pool of `requests` threads over the filesystem's blocking `cat_file`:
measured through the shaped endpoint (bench.parallel_reads), they deliver what asyncio
tasks over s3fs's `_cat_file` do, and each range reuses the bounded retry of every other
store read (ddpflow.storage.retry.retry_for, via range_read.read_range).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ddpflow.shards.index import ShardIndex
from ddpflow.shards.range_read import ShardRange, read_range, shard_ranges
from ddpflow.shards.shard_file import Buffer, Records, decode_shard
from ddpflow.storage.redact import redact_url


class EpochSink(Protocol):
    """What the reader asks of the stream whose epoch it reads (under the stream's lock,
    but for take_buffer)."""

    def is_current(self, run: int) -> bool: ...
    def batch_in_use(self) -> int: ...
    def last_batch_of(self, shard: int) -> int: ...
    def take_buffer(self, nbytes: int) -> Buffer: ...
    def deliver(
        self,
        run: int,
        shard: int,
        records: Records,
        labels: np.ndarray | None,
        buffer: Buffer,
    ) -> None: ...
    def fail(self, run: int, shard: int, error: BaseException) -> None: ...


class _NotWanted(Exception):
    """A range's epoch or shard is given up: its request, or its retries, end."""


@dataclass
class _Assembly:
    """A shard whose ranges are being read: its buffer and how many ranges are still out."""

    buffer: Buffer
    missing: int
    abandoned: bool = False  # skipped by the batches: late ranges are dropped
    failed: bool = False


@dataclass
class ReadCounters:
    """What the reader has had out at once (the bounds, measured)."""

    peak_requests: int = 0
    peak_bytes: int = 0  # bytes in flight + arrived ahead of the batches in use
    requests: int = 0  # ranges asked for, retries not counted
    bytes: int = 0


class ParallelReads:
    """Ranged reads of a stream's shards from its object store, `requests` at a time."""

    def __init__(
        self,
        index: ShardIndex,
        requests: int,
        max_bytes: int,
        chunk: int,
        bound_s: float,
        changed: threading.Condition,
    ) -> None:
        self.index = index
        self.requests = requests
        self.max_bytes = max_bytes
        self.chunk = chunk
        self.bound_s = bound_s
        self._changed = changed  # the stream's: one lock over its cache and this accounting
        self._pool: ThreadPoolExecutor | None = None  # made by the first epoch, ended by close
        self._in_flight = 0
        self._bytes_in_flight = 0
        self._arrived_ahead: dict[int, int] = {}  # shard: bytes landed before it was due
        self._first_batch: dict[int, int] = {}
        self.counters = ReadCounters()

    def _outstanding(self, pos: int) -> int:
        """Bytes in flight plus those landed for shards no batch up to `pos` needs (entries
        of shards now due are dropped: they are due for the rest of the epoch)."""
        for s in [s for s in self._arrived_ahead if self._first_batch[s] <= pos]:
            del self._arrived_ahead[s]
        return self._bytes_in_flight + sum(self._arrived_ahead.values())

    def read_epoch(
        self, sink: EpochSink, run: int, order: list[int], first_batch: dict[int, int]
    ) -> None:
        """Read the shards of `order` (first need first) for epoch `run` of `sink`; returns
        when every range is asked for, or the epoch is over. (The stream's reader thread.)"""
        with self._changed:
            if not sink.is_current(run):
                return  # replaced before this thread started: its successor's state stays
            self._first_batch = first_batch
            self._arrived_ahead = {}
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.requests, "ddpflow-shard-range")
            pool = self._pool
        assemblies: dict[int, _Assembly] = {}
        for part in shard_ranges(self.index.shards, order, self.chunk):
            s = part.shard
            with self._changed:
                while True:
                    if not sink.is_current(run):
                        return
                    pos = sink.batch_in_use()
                    if sink.last_batch_of(s) < pos:
                        break  # every batch that needs it was skipped
                    room = self._outstanding(pos) + part.nbytes <= self.max_bytes
                    if self._in_flight < self.requests and room:
                        break
                    self._changed.wait()
                if sink.last_batch_of(s) < pos:
                    if s in assemblies:
                        assemblies.pop(s).abandoned = True
                    continue
                self._in_flight += 1
                self._bytes_in_flight += part.nbytes
                counters = self.counters
                counters.peak_requests = max(counters.peak_requests, self._in_flight)
                counters.peak_bytes = max(counters.peak_bytes, self._outstanding(pos))
                counters.requests += 1
                counters.bytes += part.nbytes
            if s not in assemblies:
                nbytes = self.index.shards[s].nbytes
                missing = -(-nbytes // self.chunk)
                assemblies[s] = _Assembly(sink.take_buffer(nbytes), missing)
            assembly = assemblies[s]
            if part.last:
                del assemblies[s]  # every range of it is out: the fetches hold it now
            try:
                pool.submit(self._fetch, sink, run, part, assembly)
            except RuntimeError:  # the stream closed since the check above
                with self._changed:
                    self._in_flight -= 1
                    self._bytes_in_flight -= part.nbytes
                return

    def _fetch(self, sink: EpochSink, run: int, part: ShardRange, assembly: _Assembly) -> None:
        """One range, into its shard's buffer; the shard checked and delivered if it was
        the last one out. (A pool thread.)"""
        s = part.shard
        info = self.index.shards[s]
        uri = self.index.uri(info)
        landed = False

        def still_wanted() -> None:
            with self._changed:
                if not sink.is_current(run) or assembly.failed or assembly.abandoned:
                    raise _NotWanted

        try:
            # A range of an epoch replaced (or the stream closed), or of a shard that failed
            # or was skipped: no request, and no more retries (an exit does not wait on them).
            still_wanted()
            data = read_range(uri, info, part, self.bound_s, self.requests, still_wanted)
            view = assembly.buffer.data
            view[part.start : part.end] = data  # a copy into the shard's own place
            del data
            landed = True
        except _NotWanted:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the batch that needs it
            with self._changed:
                if not assembly.failed and not assembly.abandoned:
                    assembly.failed = True
                    sink.fail(run, s, error)
        finally:
            with self._changed:
                self._in_flight -= 1
                self._bytes_in_flight -= part.nbytes
                if landed:
                    assembly.missing -= 1
                    # Bytes of an epoch replaced since are not its successor's read-ahead.
                    ahead = self._first_batch.get(s, -1) > sink.batch_in_use()
                    if ahead and sink.is_current(run):
                        self._arrived_ahead[s] = self._arrived_ahead.get(s, 0) + part.nbytes
                complete = landed and assembly.missing == 0
                self._changed.notify_all()
        if not complete or assembly.failed or assembly.abandoned:
            return
        try:
            view = assembly.buffer.data[: info.nbytes]
            records, labels = decode_shard(
                view,
                info,
                self.index.record_shape,
                redact_url(uri),
                self.index.labeled,
                self.index.encoding,
            )
        except BaseException as error:  # noqa: BLE001 - handed to the batch that needs it
            with self._changed:
                sink.fail(run, s, error)
            return
        with self._changed:
            sink.deliver(run, s, records, labels, assembly.buffer)

    def forget_epoch(self) -> None:
        """An epoch was replaced or the stream closed (under the stream's lock): ranges of
        the old one still in flight land and are dropped; their bytes count until then."""
        self._arrived_ahead = {}
        self._first_batch = {}

    def close(self) -> None:
        """End the request threads (under the stream's lock, its epoch ended): ranges
        queued end without a request, those in flight land and are dropped (a fetch frees
        its count either way, so nothing is cancelled); a next epoch makes new threads."""
        self.forget_epoch()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
