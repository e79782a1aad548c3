"""Bounded reads against a real S3 API (a SeaweedFS server over HTTP, s3fs as in production).

The unit tests use fsspec's in-memory store; this checks what only a real S3 client shows:
ranged reads (an object rewritten larger since the listing is cut off at the cap plus one
byte, an empty object is never asked for a range S3 cannot serve), the batch deadline
passed to s3fs, and the cap and kind checks of a single read; and a stream's shards read as
ranges in parallel through a shaped endpoint (bench.s3_shaper: first-byte latency, a
rate a connection, faults), within its bounds, a range cut short retried, one that never
comes whole named.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.s3_shaper import Fault, Shaper
from ddpflow import storage
from ddpflow.shards import parallel_reads
from ddpflow.shards.index import read_index
from ddpflow.shards.shard_file import ShardError
from ddpflow.shards.stream import ShardStream
from ddpflow.storage.capped_read import ReadRefused, TooLarge
from ddpflow.training.batching import epoch_batches
from ddpflow.workloads.vision.data import ImageSpec, format_image_folder
from ddpflow.workloads.vision.objects import BadObject, read_objects
from tests.helpers.counted_reads import CountedReads
from tests.helpers.pngs import png
from tests.helpers.s3_servers import s3_client, use_s3
from tests.helpers.stream_functions import write_split

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BUCKET = "ddpflow-bounded"  # the conftest's `s3_endpoint` fixture creates it
MiB = 2**20


def test_image_reads_on_s3_are_ranged_and_empty_objects_are_bad(s3_endpoint, monkeypatch, tmp_path):
    use_s3(monkeypatch, s3_endpoint)
    s3 = s3_client(s3_endpoint)
    for c in (1, 2):
        for i in range(3):
            s3.put_object(Bucket=BUCKET, Key=f"imgs/{c}/{i}.png", Body=png(10 * i + c))
    s3.put_object(Bucket=BUCKET, Key="imgs/1/empty.png", Body=b"")
    root = f"s3://{BUCKET}/imgs"
    result = format_image_folder(root, f"s3://{BUCKET}/art", ImageSpec(8), 0.34, 0, 0.5)
    assert [(b.key, b.reason) for b in result.bad_images] == [
        ("1/empty.png", "an empty file (0 bytes)")
    ]
    assert result.num_train + result.num_val == 6
    # Listed at 100 bytes, rewritten to 3 MiB since: at most 1 MiB + 1 byte comes back.
    s3.put_object(Bucket=BUCKET, Key="imgs/2/big.png", Body=b"x" * (3 * MiB))
    out = dict(read_objects(root, ["1/0.png", "2/big.png"], MiB, {"2/big.png": 100}))
    assert out["1/0.png"] == png(1)
    assert isinstance(out["2/big.png"], BadObject)
    assert f"{MiB + 1} bytes, over the per-image cap of 1 MiB" in out["2/big.png"].reason


def test_a_single_read_on_s3_is_capped_and_takes_files_only(s3_endpoint, monkeypatch):
    use_s3(monkeypatch, s3_endpoint)
    uri = f"s3://{BUCKET}/ckpt/epoch-0001.pt"
    storage.write_bytes(uri, b"x" * 5000)
    with pytest.raises(TooLarge, match=f"{uri} is larger than .* \\(5000 bytes or more\\)"):
        storage.read_bytes(uri, 4096)
    with pytest.raises(ReadRefused, match="is not a file"):
        storage.read_bytes(f"s3://{BUCKET}/ckpt", 4096)
    assert storage.read_bytes(uri, 5000) == b"x" * 5000


KiB = 2**10
SPLIT = f"s3://{BUCKET}/parallel/train.shards.json"  # 12 shards of 40 images, 31,040 bytes


@pytest.fixture
def shaped(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Shaper]:
    """The split written to the server, then this process's S3 a shaped endpoint in front of
    it (30 ms to the first byte, 20 MB/s a connection); yields the Shaper."""
    use_s3(monkeypatch, s3_endpoint)
    if not storage.exists(SPLIT):
        write_split(SPLIT, 480, 40)
    shaper = Shaper(s3_endpoint, latency_s=0.03, rate=20e6)
    use_s3(monkeypatch, shaper.start())  # the keys sign for the proxy's host: they verify
    try:
        yield shaper
    finally:
        shaper.stop()


def _epoch(stream: ShardStream) -> list[int]:
    """The samples of one rank's epoch, read batch by batch; the stream closed after."""
    batches = epoch_batches(len(stream), 16, 0, 1, 0, 0, order=stream.epoch_order)
    stream.start_epoch(0, batches)
    seen = []
    try:
        for index in batches:
            _, labels = stream.batch(index)
            assert len(labels) == len(index)
            seen.extend(index.tolist())
    finally:
        stream.close()
    return seen


# docs/data.md "The store": ranges in flight, never more requests or bytes than the bounds.
def test_shards_from_a_shaped_s3_come_as_parallel_ranges_within_the_bounds(shaped, monkeypatch):
    reader = CountedReads()
    monkeypatch.setattr(parallel_reads, "read_range", reader)
    index = read_index(SPLIT)
    # One range held 0.3 s: the others go on around it, and the bounds still hold.
    stall = Fault(index.shards[3].name.encode(), "stall", times=1, stall_s=0.3)
    shaped.faults.append(stall)
    stream = ShardStream(
        index,
        window=2,
        requests_in_flight=8,
        max_bytes_in_flight=64 * KiB,
        chunk_bytes=8 * KiB,
    )
    assert sorted(_epoch(stream)) == list(range(480))  # every shard's CRC-32 checked
    assert 4 < reader.peak_requests <= 8 and reader.peak_bytes <= 64 * KiB
    assert shaped.connections > 4, "the ranges came over connections side by side"
    assert stall.hits == 1


# docs/data.md "Bad shards": a range cut short is retried; one that never comes whole fails
# the batch after the read bound, naming its shard.
def test_a_range_cut_short_is_retried_and_one_never_whole_names_its_shard(shaped):
    index = read_index(SPLIT)
    name = index.shards[5].name
    # Past the response's head, into its body: the client sees fewer bytes than announced.
    cut = Fault(rb"(?s)" + name.encode() + rb".*range: bytes=8192-", "cut", times=1, cut_after=3000)
    shaped.faults.append(cut)

    def stream(bound_s: float) -> ShardStream:
        return ShardStream(index, window=1, chunk_bytes=8 * KiB, read_bound_s=bound_s)

    assert sorted(_epoch(stream(30))) == list(range(480))
    assert cut.hits == 1
    cut.times = None
    with pytest.raises(ShardError, match=rf"shard s3://{BUCKET}/parallel/shards/{name} could not"):
        _epoch(stream(1.5))
    assert cut.hits > 2
