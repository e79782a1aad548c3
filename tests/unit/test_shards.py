"""Shards: the file format's checks, the world-size-independent order, and the stream's
bounded, exact delivery of each epoch (ddpflow.shards)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from ddpflow import storage
from ddpflow.shards.index import read_index, shards_folder, write_index, write_records
from ddpflow.shards.order import window_order
from ddpflow.shards.shard_file import ShardError, read_shard, write_shard
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches

SHAPE = (3, 4, 4)


def _write_split(tmp_path, counts: list[int]) -> tuple[str, np.ndarray, np.ndarray]:
    """An index over shards of `counts` records each; every record is filled with its own
    sample number (mod 251), its label is the sample number."""
    index_uri = str(tmp_path / "train.shards.json")
    total = sum(counts)
    records = (np.arange(total) % 251).astype(np.uint8)[:, None, None, None] * np.ones(
        SHAPE, np.uint8
    )
    labels = np.arange(total, dtype=np.int64)
    folder = shards_folder(index_uri)
    infos, at = [], 0
    for count in counts:  # shards of different sizes
        infos.append(write_shard(folder, records[at : at + count], labels[at : at + count]))
        at += count
    write_index(index_uri, SHAPE, tuple(infos))
    return index_uri, records, labels


def test_records_written_as_shards_read_back_in_order(tmp_path):
    records = np.arange(10 * 48, dtype=np.uint8).reshape(10, *SHAPE)
    index = write_records(str(tmp_path / "a.shards.json"), records, list(range(10)), 4)
    assert [s.count for s in index.shards] == [4, 4, 2]
    assert read_index(str(tmp_path / "a.shards.json")) == index
    x, y = ShardStream(index).batch(torch.arange(10))
    assert torch.equal(x, torch.from_numpy(records)) and y.tolist() == list(range(10))


def test_one_batch_over_more_shards_than_are_cached_reads_each_right(tmp_path):
    # Six shards in one batch outside the epoch's plan (validation's way): the cache keeps
    # two, and the buffer of a shard dropped mid-batch must not take the next one's bytes.
    records = np.arange(12 * 48, dtype=np.uint8).reshape(12, *SHAPE)
    index = write_records(str(tmp_path / "a.shards.json"), records, list(range(12)), 2)
    stream = ShardStream(index)
    for _ in range(2):
        x, y = stream.batch(torch.arange(12))
        assert torch.equal(x, torch.from_numpy(records)) and y.tolist() == list(range(12))
    assert shards_folder("train.shards.json") == "./shards"


def _epoch(stream: ShardStream, batch: int, world: int, seed: int, epoch: int, start=0):
    """Every rank's batches of one epoch, read through its own stream."""
    out = []
    for rank in range(world):
        own = ShardStream(stream.index, stream.window, stream.prefetch)
        batches = epoch_batches(
            len(own), batch, rank, world, seed, epoch, start, order=own.epoch_order
        )
        own.start_epoch(epoch, batches)
        out.append([(b, *own.batch(b)) for b in batches])
        own.close()
    return out


def test_a_shard_reads_back_and_a_damaged_one_is_named_with_the_fix(tmp_path):
    records = np.arange(2 * 48, dtype=np.uint8).reshape(2, *SHAPE)
    info = write_shard(str(tmp_path), records, [5, 7])
    got, labels = read_shard(str(tmp_path / info.name), info, SHAPE)
    assert (got == records).all() and labels.tolist() == [5, 7]
    path = tmp_path / info.name
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(ShardError, match=rf"{info.name}.*truncated.*Run the flow again"):
        read_shard(str(path), info, SHAPE)
    path.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    with pytest.raises(ShardError, match=rf"{info.name}.*CRC-32"):
        read_shard(str(path), info, SHAPE)
    path.unlink()
    with pytest.raises(ShardError, match=rf"{info.name} is missing"):
        read_shard(str(path), info, SHAPE)


def test_the_same_records_make_the_same_shard_name(tmp_path):
    records = np.ones((3, *SHAPE), np.uint8)
    a = write_shard(str(tmp_path / "a"), records, [0, 1, 2])
    b = write_shard(str(tmp_path / "b"), records, [0, 1, 2])
    c = write_shard(str(tmp_path / "c"), records, [0, 1, 3])
    assert a == b and a.name != c.name


def test_window_order_is_a_permutation_read_a_window_of_shards_at_a_time():
    counts = [10, 7, 12, 9, 11, 10, 8]
    order = window_order(counts, 2, seed=3, epoch=1)
    assert sorted(order.tolist()) == list(range(sum(counts)))
    ends = np.cumsum(counts)
    shard_of = np.searchsorted(ends, order.numpy(), side="right")
    # Cut the order where the shards seen so far are complete: every piece holds the
    # samples of at most two shards (a window), and each shard is in one piece.
    pieces, members, at = [], set(), 0
    for end, s in enumerate(shard_of.tolist(), start=1):
        members.add(s)
        if sum(counts[m] for m in members) == end - at:
            pieces.append(members)
            members, at = set(), end
    assert all(len(p) <= 2 for p in pieces) and not members
    assert sorted(s for p in pieces for s in p) == list(range(len(counts)))
    assert not torch.equal(order, window_order(counts, 2, seed=3, epoch=2))
    assert torch.equal(order, window_order(counts, 2, seed=3, epoch=1))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_sample_once_per_epoch_on_any_world_size_with_its_own_record(tmp_path, world):
    uri, records, _ = _write_split(tmp_path, [13, 9, 17, 11, 10, 12])
    stream = ShardStream(read_index(uri), window=2, prefetch=1)
    seen = []
    for rank_batches in _epoch(stream, 5, world, seed=4, epoch=0):
        for index, x, y in rank_batches:
            assert y.tolist() == index.tolist()
            assert torch.equal(x, torch.from_numpy(records[index.numpy()]))
            seen.extend(index.tolist())
    assert sorted(seen) == list(range(len(stream)))


def test_a_resume_on_fewer_ranks_sees_each_remaining_sample_once(tmp_path):
    uri, _, _ = _write_split(tmp_path, [13, 9, 17, 11, 10, 12])
    stream = ShardStream(read_index(uri), window=2)
    steps_done, batch = 3, 4
    before = _epoch(stream, batch, 3, seed=9, epoch=1)
    first = [i for rank in before for b, _, _ in rank[:steps_done] for i in b.tolist()]
    start = steps_done * batch * 3
    after = _epoch(stream, batch, 2, seed=9, epoch=1, start=start)
    rest = [i for rank in after for b, _, _ in rank for i in b.tolist()]
    assert sorted(first + rest) == list(range(len(stream)))


def test_a_rank_holds_a_bounded_number_of_shards_whatever_the_dataset_size(tmp_path):
    peaks = []
    for num_shards in (8, 32):
        folder = tmp_path / str(num_shards)
        folder.mkdir()
        uri, _, _ = _write_split(folder, [10] * num_shards)
        stream = ShardStream(read_index(uri), window=2, prefetch=1)
        _epoch(stream, 4, 2, seed=1, epoch=0)
        own = ShardStream(stream.index, 2, 1)
        batches = epoch_batches(len(own), 4, 0, 2, 1, 0, order=own.epoch_order)
        own.start_epoch(0, batches)
        for b in batches:
            own.batch(b)
        peaks.append(own.peak_shards)
    # Two windows at a window's edge plus one read ahead: 5, not the dataset's 8 or 32.
    assert peaks[0] <= 5 and peaks[1] <= 5


def test_a_shard_deleted_after_formatting_fails_the_batch_that_needs_it_naming_it(tmp_path):
    uri, _, _ = _write_split(tmp_path, [10, 10, 10, 10])
    index = read_index(uri)
    stream = ShardStream(index, window=1, prefetch=1)
    storage.delete(index.uri(index.shards[2]))  # after the stream checked the sizes
    batches = epoch_batches(len(stream), 5, 0, 1, 0, 0, order=stream.epoch_order)
    stream.start_epoch(0, batches)
    served = 0
    result: dict[str, BaseException] = {}

    def consume() -> None:
        nonlocal served
        try:
            for b in batches:
                stream.batch(b)
                served += 1
        except ShardError as error:
            result["error"] = error

    thread = threading.Thread(target=consume)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a missing shard must fail the batch, not hang it"
    assert index.shards[2].name in str(result["error"])
    assert served < len(batches), "no batch after the missing shard was served"


def test_a_batch_waiting_for_its_shard_says_it_is_alive(tmp_path, monkeypatch):
    uri, _, _ = _write_split(tmp_path, [10, 10])
    beats = []
    stream = ShardStream(read_index(uri), window=1, prefetch=0, on_wait=lambda: beats.append(1))
    real = stream._read

    def slow(s: int):
        time.sleep(2.5)
        return real(s)

    monkeypatch.setattr(stream, "_read", slow)
    monkeypatch.setattr("ddpflow.shards.stream.WAIT_BEAT_S", 0.2)
    batches = epoch_batches(len(stream), 5, 0, 1, 0, 0, order=stream.epoch_order)
    stream.start_epoch(0, batches)
    stream.batch(batches[0])
    assert len(beats) >= 5


def test_a_skipped_batch_keeps_the_stream_planned_and_bounded(tmp_path):
    uri, records, _ = _write_split(tmp_path, [10] * 16)
    stream = ShardStream(read_index(uri), window=2, prefetch=1)
    batches = epoch_batches(len(stream), 4, 0, 1, 0, 0, order=stream.epoch_order)
    stream.start_epoch(0, batches)
    for i, b in enumerate(batches):
        if i % 7 == 3:
            continue  # a caller that skips a batch now and then
        x, _ = stream.batch(b)
        assert torch.equal(x, torch.from_numpy(records[b.numpy()]))
    assert stream.peak_shards <= 5
    assert not stream._unplanned, "every batch was served from the plan"


def test_batches_of_another_order_are_warned_about(tmp_path, caplog):
    uri, _, _ = _write_split(tmp_path, [10] * 16)
    stream = ShardStream(read_index(uri), window=2, prefetch=1)
    uniform = epoch_batches(len(stream), 4, 0, 1, 0, 0)  # epoch_order left out
    with caplog.at_level("WARNING"):
        stream.start_epoch(0, uniform)
    assert "draw the epoch's order from ShardStream.epoch_order" in caplog.text
    stream.close()
