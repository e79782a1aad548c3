"""A split streamed from its shards: ddpflow.training.samples's `Samples`, bounded in memory.

fit() draws the epoch's order from `epoch_order` (ddpflow.shards.order: windows of shards),
tells the stream the rank's batches with `start_epoch`, then asks for them one by one. From
those batches the stream knows which shards each needs and when each is needed last, and
reads them in the order of first need; a shard is dropped after the last batch that needs
it. Local shards are read whole by a thread, at most `prefetch` shards ahead of the ones in
use; shards in an object store as ranged GETs, `requests_in_flight` at once, at most
`max_bytes_in_flight` bytes out or arrived ahead of the ones in use
(ddpflow.shards.parallel_reads). A rank thus holds the shards its current batches span plus
a bounded read-ahead, whatever the size of the dataset.

Any other access (validation reads its part in index order) goes through a small
least-recently-used set of shards, read when asked.

A compressed (jpeg) split's shards hold encoded records: each planned batch is decoded on
the stream's decoding pool (ddpflow.shards.decoding), `decode_ahead` batches ahead of the one
in use, so the training thread takes batches already decoded while the pool works on the
next ones. A decode waits for its batch's shards like the batch would, copies its records
out under the stream's lock (a dropped shard's buffer is reused), and is given up when its
batch is skipped or its epoch replaced. The order, the samples of each batch and what
they are augmented with do not depend on the encoding.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from ddpflow import storage
from ddpflow.shards.decoding import RecordAt, RecordDecoder
from ddpflow.shards.index import ShardIndex, check_stored_sizes
from ddpflow.shards.order import window_order
from ddpflow.shards.parallel_reads import ParallelReads
from ddpflow.shards.records import EncodedRecords
from ddpflow.shards.settings import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_DECODE_AHEAD,
    DEFAULT_DECODE_THREADS,
    DEFAULT_MAX_BYTES_IN_FLIGHT,
    DEFAULT_PREFETCH,
    DEFAULT_READ_BOUND_S,
    DEFAULT_REQUESTS_IN_FLIGHT,
    DEFAULT_WINDOW,
    StreamSettings,
)
from ddpflow.shards.shard_file import Buffer, Records, read_shard
from ddpflow.storage.redact import redact_url
from ddpflow.training.samples import Batch, ToBatch

log = logging.getLogger(__name__)

UNPLANNED_SHARDS = 2  # shards kept for reads outside the epoch's plan (validation)
# How far ahead of the next planned batch a batch is looked for (a caller that skipped some).
PLAN_LOOKAHEAD = 8
# How often a batch that waits for its shard says it is alive (the launcher's hang watch).
WAIT_BEAT_S = 2.0


@dataclass(frozen=True)
class _Held:
    """A shard in memory: views of its bytes, and the buffer they are in (reused once the
    shard is dropped; None: bytes of their own)."""

    records: Records  # uint8 [count, *shape], or a compressed shard's encoded records
    labels: np.ndarray | None  # None: an index of records alone
    buffer: Buffer | None


class ShardStream:
    """The samples of a ShardIndex, read shard by shard as the rank's batches need them.

    A compressed split's batches are decoded by `decode_threads` threads, up to
    `decode_ahead` batches ahead of the one in use; with `decode_device` a CUDA device they
    are decoded there, in one nvJPEG call a batch, and its images come back on that device
    (its labels on the CPU). A raw split ignores the three."""

    def __init__(
        self,
        index: ShardIndex,
        window: int = DEFAULT_WINDOW,
        prefetch: int = DEFAULT_PREFETCH,
        on_wait: Callable[[], None] | None = None,
        read_bound_s: float = DEFAULT_READ_BOUND_S,
        to_batch: ToBatch | None = None,
        requests_in_flight: int = DEFAULT_REQUESTS_IN_FLIGHT,
        max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        decode_threads: int = DEFAULT_DECODE_THREADS,
        decode_ahead: int = DEFAULT_DECODE_AHEAD,
        decode_device: torch.device | str | None = None,
    ) -> None:
        StreamSettings(  # checks them
            window,
            prefetch,
            read_bound_s,
            requests_in_flight,
            max_bytes_in_flight,
            chunk_bytes,
            decode_threads,
            decode_ahead,
        )
        if not index.labeled and to_batch is None:
            raise ValueError(
                "the index lists records without labels: pass to_batch, which makes a batch "
                "of records into (inputs, targets)"
            )
        # Before any order is sized from the index's counts: they must be the stored bytes'.
        check_stored_sizes(index)
        self.to_batch = to_batch
        self.index = index
        self.window = window
        self.prefetch = prefetch
        self.read_bound_s = read_bound_s
        self.on_wait = on_wait  # called while a batch waits for a shard (a heartbeat)
        counts = np.array([s.count for s in index.shards], dtype=np.int64)
        self._ends = np.cumsum(counts)
        self._starts = self._ends - counts
        self._changed = threading.Condition()
        self._cache: dict[int, _Held] = {}
        self._errors: dict[int, BaseException] = {}
        self._plan: list[tuple[int, ...]] = []
        self._batches: list[torch.Tensor] = []
        self._last_use: dict[int, int] = {}
        self._pos = 0
        self._epoch_run = 0  # bumped by each start_epoch: an older reader thread stops
        self._unplanned: OrderedDict[int, _Held] = OrderedDict()
        # Buffers of dropped shards: the next read goes into one large enough
        # (shard_file.read_shard, parallel_reads), so memory is what is held.
        self._spare: list[Buffer] = []
        self._retired: list[_Held] = []  # dropped during a batch, released after it
        self._local = isinstance(storage.url_to_fs(index.folder)[0], LocalFileSystem)
        # An object store's planned shards come as ranges, several at once (one GET runs
        # at one connection's rate); local ones whole, by one thread, one readinto each
        # into a reused buffer (docs/data.md: 1.4x the in-memory split already).
        self.ranges = (
            None
            if self._local
            else ParallelReads(
                index,
                requests_in_flight,
                max_bytes_in_flight,
                chunk_bytes,
                read_bound_s,
                self._changed,
            )
        )
        self.peak_shards = 0  # the most shards held at once (the memory bound, measured)
        self.decode_ahead = decode_ahead
        self.decoder = (
            None
            if index.encoding.raw
            else RecordDecoder(index.record_shape, decode_threads, decode_device)
        )
        # Planned batches being decoded, by their position in the plan: the one in use and
        # up to decode_ahead after it.
        self._decoding: dict[int, Future[Batch | None]] = {}

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        return window_order([s.count for s in self.index.shards], self.window, seed, epoch)

    def shards_of(self, index: torch.Tensor) -> np.ndarray:
        """The shard number of each sample of `index`."""
        return np.searchsorted(self._ends, index.numpy(), side="right")

    def start_epoch(self, epoch: int, batches: Sequence[torch.Tensor]) -> None:
        """Plan the rank's `batches` (the rest of the epoch) and start reading ahead."""
        plan = [tuple(np.unique(self.shards_of(b)).tolist()) for b in batches]
        last_use = {s: i for i, needed in enumerate(plan) for s in needed}
        first_need: list[int] = []
        first_batch: dict[int, int] = {}
        live, max_live = 0, 0
        for i, needed in enumerate(plan):
            for s in needed:
                if s not in first_batch:
                    first_batch[s] = i
                    first_need.append(s)
                    live += 1
            max_live = max(max_live, live)
            live -= sum(1 for s in needed if last_use[s] == i)
        if max_live > 2 * self.window + 1:
            # Batches over a window order span at most two windows (and a global batch
            # larger than a window's samples, more): this is another order, and the stream
            # will hold all those shards at once.
            log.warning(
                "the batches of epoch %d span up to %d shards at once (window %d): draw the "
                "epoch's order from ShardStream.epoch_order to keep a rank's memory bounded",
                epoch,
                max_live,
                self.window,
            )
        with self._changed:
            self._epoch_run += 1
            run = self._epoch_run
            self._drop_all_planned()
            self._give_up_decodes()
            self._errors.clear()
            self._plan, self._last_use, self._pos = plan, last_use, 0
            self._batches = list(batches)
            if self.ranges is not None:
                self.ranges.forget_epoch()
            self._changed.notify_all()
        reader: Callable[[], None]
        if self.ranges is not None:
            reader = partial(self.ranges.read_epoch, self, run, first_need, first_batch)
        else:
            # Loaded in first-need order, a shard a batch waits for always comes before any
            # shard read ahead, so `max_live + prefetch` can never block the reader on it.
            reader = partial(self._read_ahead, run, first_need, max_live + self.prefetch)
        thread = threading.Thread(target=reader, name=f"ddpflow-shards-epoch-{epoch}", daemon=True)
        thread.start()

    # The parallel reader's side (parallel_reads.EpochSink), called under self._changed.

    def is_current(self, run: int) -> bool:
        return self._epoch_run == run

    def batch_in_use(self) -> int:
        return self._pos

    def last_batch_of(self, shard: int) -> int:
        return self._last_use[shard]

    def deliver(
        self,
        run: int,
        shard: int,
        records: Records,
        labels: np.ndarray | None,
        buffer: Buffer,
    ) -> None:
        held = _Held(records, labels, buffer)
        if self._epoch_run != run or self._last_use[shard] < self._pos:
            self._release(held)  # the epoch was replaced, or its batches skipped
            return
        self._cache[shard] = held
        self.peak_shards = max(self.peak_shards, len(self._cache) + len(self._unplanned))
        self._changed.notify_all()

    def fail(self, run: int, shard: int, error: BaseException) -> None:
        if self._epoch_run == run:
            self._errors[shard] = error
            self._changed.notify_all()

    def _read_ahead(self, run: int, order: list[int], capacity: int) -> None:
        for s in order:
            with self._changed:
                while self._epoch_run == run and len(self._cache) >= capacity:
                    self._changed.wait()
                if self._epoch_run != run:
                    return
                if self._last_use[s] < self._pos:
                    continue  # every batch that needed it was skipped
            try:
                arrays = self._read(s)
            except BaseException as error:  # noqa: BLE001 - handed to the batch that needs it
                with self._changed:
                    if self._epoch_run == run:
                        self._errors[s] = error
                        self._changed.notify_all()
                return
            with self._changed:
                if self._epoch_run != run:
                    return
                if self._last_use[s] < self._pos:
                    self._release(arrays)  # skipped while it was read
                    continue
                self._cache[s] = arrays
                self.peak_shards = max(self.peak_shards, len(self._cache) + len(self._unplanned))
                self._changed.notify_all()

    def _read(self, s: int) -> _Held:
        shard = self.index.shards[s]
        uri = self.index.uri(shard)
        handed: list[Buffer] = []

        def buffer_of(nbytes: int) -> Buffer:
            handed.append(self.take_buffer(nbytes))
            return handed[-1]

        records, labels = read_shard(
            uri,
            shard,
            self.index.record_shape,
            self.read_bound_s,
            buffer=buffer_of if self._local else None,
            labeled=self.index.labeled,
            encoding=self.index.encoding,
        )
        return _Held(records, labels, handed[0] if handed else None)

    def take_buffer(self, nbytes: int) -> Buffer:
        """A spare buffer of at least nbytes, else a new one of nbytes (called once the
        shard's file is known to be that large, or its size checked at the start: never on
        the index's word alone). A new one is not touched until bytes are read into it, so
        its pages become memory as they arrive."""
        with self._changed:
            for i, spare in enumerate(self._spare):
                if len(spare) >= nbytes:
                    return self._spare.pop(i)
        return np.empty(nbytes, np.uint8)

    def _release(self, held: _Held | None) -> None:
        """Drop a shard; its buffer, if any, serves the next read. (The caller holds the
        lock, or is the only thread touching the unplanned set.)"""
        if held is not None and held.buffer is not None:
            self._spare.append(held.buffer)

    def _drop_all_planned(self) -> None:
        for held in self._cache.values():
            self._release(held)
        self._cache.clear()

    def batch(self, index: torch.Tensor) -> Batch:
        """(uint8 records [n, *record_shape], int64 labels [n]) of the samples at `index`;
        with `to_batch`, what it makes of the records."""
        sids = self.shards_of(index)
        needed = tuple(np.unique(sids).tolist())
        planned = self._find_planned(index)
        if self.decoder is not None:
            images, labels = self._decoded_batch(index, sids, needed, planned)
        else:
            arrays = (
                self._planned(needed) if planned else {s: self._unplanned_read(s) for s in needed}
            )
            images, labels = self._sliced_batch(index, sids, needed, arrays)
        if planned:
            self._done_with_batch()
        with self._changed:
            for held in self._retired:
                self._release(held)
            self._retired.clear()
        if self.to_batch is not None:
            return self.to_batch(images)
        return images, labels

    def _sliced_batch(
        self,
        index: torch.Tensor,
        sids: np.ndarray,
        needed: tuple[int, ...],
        arrays: dict[int, _Held],
    ) -> Batch:
        """A raw split's batch: its records copied out of the shards' arrays."""
        rows = index.numpy() - self._starts[sids]
        records = np.empty((len(index), *self.index.record_shape), dtype=np.uint8)
        labels = np.empty(len(index), dtype=np.int64)
        for s in needed:
            at = np.flatnonzero(sids == s)
            shard_records = arrays[s].records
            assert isinstance(shard_records, np.ndarray)  # a raw index's shards are arrays
            records[at] = shard_records[rows[at]]
            if self.index.labeled:
                shard_labels = arrays[s].labels
                assert shard_labels is not None  # a labeled index's shards carry labels
                labels[at] = shard_labels[rows[at]]
        return torch.from_numpy(records), torch.from_numpy(labels)

    def _encoded(
        self,
        index: torch.Tensor,
        sids: np.ndarray,
        needed: tuple[int, ...],
        arrays: dict[int, _Held],
    ) -> tuple[list[np.ndarray], list[RecordAt], torch.Tensor]:
        """A compressed split's batch before decoding: copies of its encoded records, where
        each is from, and the labels. (Under the lock for planned shards: copied before a
        dropped shard's buffer can be reused.)"""
        rows = index.numpy() - self._starts[sids]
        records: list[np.ndarray] = [np.empty(0, np.uint8)] * len(index)
        where: list[RecordAt] = [RecordAt("", 0)] * len(index)
        labels = np.empty(len(index), dtype=np.int64)
        for s in needed:
            at = np.flatnonzero(sids == s)
            held = arrays[s]
            assert isinstance(held.records, EncodedRecords)  # a compressed index's shards
            shown = redact_url(self.index.uri(self.index.shards[s]))
            for i, data in zip(at.tolist(), held.records.take(rows[at]), strict=True):
                records[i] = data
                where[i] = RecordAt(shown, int(rows[i]))
            if self.index.labeled:
                assert held.labels is not None  # a labeled index's shards carry labels
                labels[at] = held.labels[rows[at]]
        return records, where, torch.from_numpy(labels)

    def _decoded_batch(
        self, index: torch.Tensor, sids: np.ndarray, needed: tuple[int, ...], planned: bool
    ) -> Batch:
        decoder = self.decoder
        assert decoder is not None  # a compressed split
        if not planned:  # validation's way: nothing decoded it ahead, the pool decodes it now
            arrays = {s: self._unplanned_read(s) for s in needed}
            records, where, labels = self._encoded(index, sids, needed, arrays)
            return decoder.decode_spread(records, where), labels
        with self._changed:
            pos = self._pos
            self._decode_ahead_of(pos)
            future = self._decoding.pop(pos)
        while True:
            try:
                decoded = future.result(timeout=WAIT_BEAT_S)
                break
            except FutureTimeout:
                if self.on_wait is not None:
                    self.on_wait()  # still alive, waiting for a shard or its decode
        assert decoded is not None  # the batch in use is never given up
        return decoded

    def _decode_ahead_of(self, pos: int) -> None:
        """Have the batch at `pos` and up to decode_ahead after it decoding. (Under the lock.)"""
        decoder = self.decoder
        assert decoder is not None
        for j in range(pos, min(pos + 1 + self.decode_ahead, len(self._batches))):
            if j not in self._decoding:
                work = partial(self._decode_planned, self._epoch_run, j, self._batches[j])
                self._decoding[j] = decoder.submit(work)

    def _decode_planned(self, run: int, j: int, index: torch.Tensor) -> Batch | None:
        """Planned batch `j` of epoch `run`, decoded (a decoding thread); None when it was
        given up while waiting for its shards (skipped, or its epoch replaced)."""
        decoder = self.decoder
        assert decoder is not None
        sids = self.shards_of(index)
        needed = tuple(np.unique(sids).tolist())
        with self._changed:
            arrays = self._wait_for(needed, lambda: self._epoch_run != run or self._pos > j)
            if arrays is None:
                return None
            records, where, labels = self._encoded(index, sids, needed, arrays)
        return decoder.decode(records, where), labels

    def _give_up_decodes(self) -> None:
        """Drop every planned decode (under the lock): those waiting see it and return."""
        for future in self._decoding.values():
            future.cancel()
        self._decoding.clear()

    def _find_planned(self, index: torch.Tensor) -> bool:
        """Whether `index` is the next planned batch, or one a few batches on (those skipped
        are taken as done, so their shards are dropped and the read-ahead goes on)."""
        with self._changed:
            pos = self._pos
            ahead = self._batches[pos : pos + PLAN_LOOKAHEAD]
            at = next((i for i, b in enumerate(ahead) if b is index), None)
            if at is None and ahead and torch.equal(ahead[0], index):
                at = 0
        for _ in range(at or 0):
            self._done_with_batch()
        return at is not None

    def _planned(self, needed: tuple[int, ...]) -> dict[int, _Held]:
        with self._changed:
            held = self._wait_for(needed, on_wait=self.on_wait)
        assert held is not None  # never given up
        return held

    def _wait_for(
        self,
        needed: tuple[int, ...],
        given_up: Callable[[], bool] = lambda: False,
        on_wait: Callable[[], None] | None = None,
    ) -> dict[int, _Held] | None:
        """The planned shards `needed` once all are read (under the lock): a read's error
        is raised, `on_wait` called at each beat without news; None once `given_up()`."""
        while True:
            if given_up():
                return None
            for s in needed:
                if s in self._errors:
                    raise self._errors[s]
            if all(s in self._cache for s in needed):
                return {s: self._cache[s] for s in needed}
            if not self._changed.wait(WAIT_BEAT_S) and on_wait is not None:
                on_wait()

    def _done_with_batch(self) -> None:
        with self._changed:
            pos = self._pos
            for s in self._plan[pos]:
                if self._last_use.get(s) == pos:
                    self._release(self._cache.pop(s, None))
            skipped = self._decoding.pop(pos, None)  # a batch skipped: its decode is not used
            if skipped is not None:
                skipped.cancel()
            self._pos = pos + 1
            self._changed.notify_all()

    def _unplanned_read(self, s: int) -> _Held:
        if s in self._unplanned:
            self._unplanned.move_to_end(s)
            return self._unplanned[s]
        arrays = self._read(s)
        self._unplanned[s] = arrays
        with self._changed:
            while len(self._unplanned) > UNPLANNED_SHARDS:
                # Not released yet: this batch may still read the shard it held.
                self._retired.append(self._unplanned.popitem(last=False)[1])
            self.peak_shards = max(self.peak_shards, len(self._cache) + len(self._unplanned))
        return arrays

    def close(self) -> None:
        """Stop reading ahead and drop every shard held."""
        with self._changed:
            self._epoch_run += 1
            if self.ranges is not None:
                self.ranges.close()
            self._give_up_decodes()
            if self.decoder is not None:
                self.decoder.close()
            self._drop_all_planned()
            self._plan, self._batches = [], []
            self._unplanned.clear()
            self._spare.clear()
            self._changed.notify_all()
