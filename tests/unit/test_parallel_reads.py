"""Shards from an object store as ranged reads in parallel (ddpflow.shards.parallel_reads):
bounded requests and bytes, the plan's order, the local stream's bytes straight and resumed,
and a range that fails or comes back short retried, then the shard named.

fsspec's in-memory filesystem stands in for the store: it is not a local folder, so the
stream reads it through the parallel reader, as it reads S3 (integration/
test_bounded_s3_reads.py does the same against a SeaweedFS server through a shaped
endpoint)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from ddpflow.shards import parallel_reads
from ddpflow.shards.index import read_index, shards_folder, write_index
from ddpflow.shards.range_read import shard_ranges
from ddpflow.shards.shard_file import ShardError, write_shard
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches
from tests.helpers.counted_reads import CountedReads

pytestmark = pytest.mark.timeout(60)  # a reader that blocks a batch fails, not hangs
SHAPE = (3, 4, 4)  # 48 bytes a record, 56 with its label
CHUNK = 100  # bytes a range: a shard of 10 records is 6 ranges
SHARD_BYTES = 10 * 56


@pytest.fixture
def store() -> Iterator[str]:
    root = f"memory://parallel-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _write_split(folder: str, counts: list[int]) -> tuple[str, np.ndarray]:
    """An index over shards of `counts` records; record i is filled with i mod 251, its
    label is i."""
    uri = f"{folder}/train.shards.json"
    total = sum(counts)
    records = (np.arange(total) % 251).astype(np.uint8)[:, None, None, None] * np.ones(
        SHAPE, np.uint8
    )
    labels = np.arange(total, dtype=np.int64)
    infos, at = [], 0
    for count in counts:
        infos.append(
            write_shard(shards_folder(uri), records[at : at + count], labels[at : at + count])
        )
        at += count
    write_index(uri, SHAPE, tuple(infos))
    return uri, records


def _rank_epoch(
    stream: ShardStream, world: int, rank: int, epoch: int, start: int = 0, step_s: float = 0.0
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    batches = epoch_batches(len(stream), 4, rank, world, 7, epoch, start, order=stream.epoch_order)
    stream.start_epoch(epoch, batches)
    out = []
    for b in batches:
        out.append((b, *stream.batch(b)))
        time.sleep(step_s)
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_ranges_in_parallel_deliver_each_sample_once_with_its_record(store, world):
    uri, records = _write_split(store, [13, 9, 17, 11, 10, 12])
    seen = []
    for rank in range(world):
        stream = ShardStream(
            read_index(uri),
            window=2,
            requests_in_flight=4,
            max_bytes_in_flight=400,
            chunk_bytes=CHUNK,
        )
        for index, x, y in _rank_epoch(stream, world, rank, epoch=0):
            assert y.tolist() == index.tolist()
            assert torch.equal(x, torch.from_numpy(records[index.numpy()]))
            seen.extend(index.tolist())
        assert stream.ranges is not None and stream.ranges.counters.requests > 6
        stream.close()
    assert sorted(seen) == list(range(len(records)))


@pytest.mark.parametrize(("requests", "max_bytes"), [(3, 10_000), (8, 250)])
def test_requests_and_bytes_out_never_exceed_the_bounds_whatever_the_dataset_size(
    store, monkeypatch, requests, max_bytes
):
    reader = CountedReads(delay_s=0.004)
    monkeypatch.setattr(parallel_reads, "read_range", reader)
    issued: list[tuple[int, int]] = []  # the reader's plan, range by range as it goes

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        for part in shard_ranges(*args, **kwargs):
            issued.append((part.shard, part.start))
            yield part

    monkeypatch.setattr(parallel_reads, "shard_ranges", recorded)
    for num_shards in (8, 32):
        uri, records = _write_split(f"{store}/{num_shards}", [10] * num_shards)
        stream = ShardStream(
            read_index(uri),
            window=2,
            requests_in_flight=requests,
            max_bytes_in_flight=max_bytes,
            chunk_bytes=CHUNK,
        )
        reader.asked.clear()
        issued.clear()
        served = _rank_epoch(stream, 1, 0, epoch=1, step_s=0.002)
        for index, x, _ in served:
            assert torch.equal(x, torch.from_numpy(records[index.numpy()]))
        assert stream.ranges is not None
        counters = stream.ranges.counters
        # Out at once, counted by the reader itself and by the stream's own accounting
        # (which adds the bytes arrived for shards no batch needs yet).
        assert 1 < reader.peak_requests <= requests
        assert reader.peak_bytes <= max_bytes and counters.peak_bytes <= max_bytes
        assert counters.peak_requests <= requests
        # The plan: every range of every shard, in the order the batches first need the
        # shards, each asked for once (the request threads may start a few out of turn).
        needed = [s for i, _, _ in served for s in np.unique(stream.shards_of(i)).tolist()]
        first_need = list(dict.fromkeys(needed))
        planned = [(r.shard, r.start) for r in shard_ranges(stream.index.shards, first_need, CHUNK)]
        assert issued == planned
        assert sorted(reader.asked) == sorted(planned)
        # The shards held: those the batches in use span (2 windows + 1 at most) and those
        # the byte bound let arrive whole ahead of them, at 8 shards as at 32.
        assert stream.peak_shards <= 5 + max_bytes // SHARD_BYTES
        stream.close()


def test_parallel_reads_serve_the_local_streams_bytes_straight_and_resumed(store, tmp_path):
    counts = [13, 9, 17, 11, 10, 12]
    remote, _ = _write_split(store, counts)
    local, _ = _write_split(str(tmp_path), counts)

    def run(uri: str, world: int, start: int) -> list[list[tuple[list[int], bytes, list[int]]]]:
        ranks = []
        for rank in range(world):
            stream = ShardStream(
                read_index(uri),
                window=2,
                requests_in_flight=3,
                max_bytes_in_flight=300,
                chunk_bytes=CHUNK,
            )
            got = _rank_epoch(stream, world, rank, epoch=2, start=start)
            ranks.append([(i.tolist(), x.numpy().tobytes(), y.tolist()) for i, x, y in got])
            stream.close()
        return ranks

    # Straight on 3 ranks, then resumed after 3 steps on 2: each sample's bytes and label
    # are the local stream's (integration/test_streaming.py resumes that one exactly).
    for world, start in ((3, 0), (2, 3 * 4 * 3)):
        assert run(remote, world, start) == run(local, world, start)


@pytest.mark.parametrize("fault", ["short", "fails"])
def test_a_range_that_fails_or_comes_back_short_is_retried_then_names_its_shard(
    store, monkeypatch, fault
):
    uri, records = _write_split(store, [10, 10, 10, 10])
    index = read_index(uri)
    target = index.shards[2].name
    real = MemoryFileSystem.cat_file
    bad = {"left": 1, "served": 0}

    def cat_file(self, path, start=None, end=None, **kwargs):  # noqa: ANN001, ANN202
        if path.endswith(target) and start == CHUNK and bad["left"] != 0:
            bad["left"] -= 1
            bad["served"] += 1
            if fault == "fails":
                raise ConnectionResetError("the store dropped the connection")
            return real(self, path, start, end, **kwargs)[:-1]
        return real(self, path, start, end, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)

    def stream(bound_s: float) -> ShardStream:
        return ShardStream(
            index, window=1, requests_in_flight=4, chunk_bytes=CHUNK, read_bound_s=bound_s
        )

    # Once bad, then good: retried (about a second later), and every record is right.
    for b, x, _ in _rank_epoch(stream(30), 1, 0, epoch=0):
        assert torch.equal(x, torch.from_numpy(records[b.numpy()]))
    assert bad["served"] == 1 and bad["left"] == 0
    # Bad for good: retried until the read bound, then the batch that needs it fails
    # naming the shard, and no batch after it is served.
    bad["left"] = -1
    started = time.monotonic()
    with pytest.raises(ShardError, match=rf"shard .*{target} could not be read") as error:
        _rank_epoch(stream(1.5), 1, 0, epoch=0)
    assert "still failed after" in str(error.value) and bad["served"] >= 3
    assert time.monotonic() - started < 20


def test_a_shard_changed_under_the_stream_fails_at_once_naming_it(store):
    uri, _ = _write_split(store, [10, 10, 10])
    index = read_index(uri)
    fs = fsspec.filesystem("memory")
    for change, says in ((lambda b: b[:-5], "truncated or replaced"), (lambda b: b + b"x", "more")):
        stream = ShardStream(index, window=1, chunk_bytes=CHUNK, read_bound_s=60)
        path = index.uri(index.shards[1])
        data = fs.cat_file(path)
        fs.pipe_file(path, change(data))  # after the stream checked the stored sizes
        started = time.monotonic()
        with pytest.raises(ShardError, match=rf"{index.shards[1].name} .*{says}"):
            _rank_epoch(stream, 1, 0, epoch=0)
        assert time.monotonic() - started < 10, "no retry mends a changed shard"
        fs.pipe_file(path, data)
        stream.close()
