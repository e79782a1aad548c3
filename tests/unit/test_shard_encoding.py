"""Compressed (jpeg) shards: the format (ddpflow.shards.records, .index), the rank's decoding
off the training thread (ddpflow.shards.decoding, .stream), the GPU branch (with a mock:
the suite has no GPU), damaged records, and the encoding reaching the image format step."""

from __future__ import annotations

import json
import threading
import time
import zlib
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from ddpflow.shards import decoding
from ddpflow.shards.encoding import RAW, ShardEncoding
from ddpflow.shards.index import read_index, write_index, write_records
from ddpflow.shards.jpeg import decode_cpu, encode_images, frame_size
from ddpflow.shards.records import pack_records
from ddpflow.shards.shard_file import SUFFIX, ShardError, ShardInfo
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches
from ddpflow.workloads.vision.data import ImageSpec, open_split
from ddpflow.workloads.vision.shard_format import format_shards, plan_shards
from tests.helpers.pngs import png

JPEG = ShardEncoding("jpeg", 90)
SIDE = 16


def _images(n: int, side: int = SIDE, seed: int = 0) -> np.ndarray:
    """Smooth images (upscaled noise: JPEG's kind of picture), uint8 [n, 3, side, side]."""
    small = torch.rand(n, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    big = torch.nn.functional.interpolate(small, size=side, mode="bilinear")
    return (big * 255).to(torch.uint8).numpy()


def _split(tmp_path, n: int = 60, per_shard: int = 8, encoding: ShardEncoding = JPEG):
    images = _images(n)
    index = write_records(
        str(tmp_path / "t.shards.json"), images, list(range(n)), per_shard, encoding
    )
    return index, images


def test_jpeg_records_read_back_close_to_the_images_and_raw_indexes_stay_as_before(tmp_path):
    index, images = _split(tmp_path)
    stored = json.loads((tmp_path / "t.shards.json").read_text())
    assert stored["encoding"] == {"kind": "jpeg", "quality": 90}
    assert read_index(str(tmp_path / "t.shards.json")) == index
    x, y = ShardStream(index).batch(torch.arange(60))
    assert x.dtype == torch.uint8 and tuple(x.shape) == (60, 3, SIDE, SIDE)
    assert y.tolist() == list(range(60))
    assert (x.float() - torch.from_numpy(images).float()).abs().mean() < 10  # of 255
    # A raw index is written as before encodings existed, and one without the field is raw.
    raw = write_records(str(tmp_path / "r.shards.json"), images, list(range(60)), 8)
    fields = json.loads((tmp_path / "r.shards.json").read_text())
    assert list(fields) == ["version", "record_shape", "labeled", "shards"]
    assert read_index(str(tmp_path / "r.shards.json")).encoding == RAW == raw.encoding
    assert ShardEncoding("raw", 60) == RAW  # raw has no quality


def test_a_planned_epoch_decodes_each_batch_as_a_direct_read_does_straight_and_resumed(tmp_path):
    index, _ = _split(tmp_path, n=90, per_shard=10)
    expected, labels = ShardStream(index).batch(torch.arange(90))  # outside any plan
    for start in (0, 5):  # a resume inside the epoch, at the 5th batch
        stream = ShardStream(index, window=2, decode_threads=2, decode_ahead=2)
        batches = epoch_batches(len(stream), 7, 0, 1, 3, 1, start, order=stream.epoch_order)
        stream.start_epoch(1, batches)
        for b in batches:
            x, y = stream.batch(b)
            assert torch.equal(x, expected[b]) and torch.equal(y, labels[b])
        stream.close()


def test_decoding_runs_on_threads_a_bounded_number_of_batches_ahead(tmp_path, monkeypatch):
    index, _ = _split(tmp_path, n=80, per_shard=10)
    decoded: list[tuple[str, float]] = []
    real = decoding.RecordDecoder.decode

    def watched(self, records, where):  # noqa: ANN001, ANN202
        decoded.append((threading.current_thread().name, time.monotonic()))
        return real(self, records, where)

    monkeypatch.setattr(decoding.RecordDecoder, "decode", watched)
    stream = ShardStream(index, decode_threads=2, decode_ahead=2)
    batches = epoch_batches(len(stream), 5, 0, 1, 0, 0, order=stream.epoch_order)
    stream.start_epoch(0, batches)
    for i, b in enumerate(batches):
        stream.batch(b)
        time.sleep(0.05)  # a step: the pool decodes ahead meanwhile, never past its bound
        assert len(decoded) <= i + 1 + 2, "decoded more than decode_ahead batches ahead"
        if i == 3:
            assert len(decoded) == i + 1 + 2, "the next batches were decoded during the step"
    stream.close()
    assert len(decoded) == len(batches)
    assert all(name.startswith("ddpflow-decode") for name, _ in decoded)


def _damaged_split(tmp_path, record: bytes) -> tuple[ShardStream, str]:
    """A jpeg split of one shard of 6 records whose record 3 is `record`, its CRC-32 right:
    bytes written damaged, not changed since."""
    encoded = encode_images(_images(6), 90)
    encoded[3] = record
    data = pack_records(encoded, [0, 1, 2, 3, 4, 5])
    name = zlib.crc32(data).to_bytes(4).hex() * 4 + SUFFIX
    folder = tmp_path / "shards"
    folder.mkdir(parents=True)
    (folder / name).write_bytes(data)
    info = ShardInfo(name, 6, len(data), zlib.crc32(data))
    uri = str(tmp_path / "d.shards.json")
    write_index(uri, (3, SIDE, SIDE), (info,), encoding=JPEG)
    return ShardStream(read_index(uri)), name


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (encode_images(_images(1), 90)[0][:200], "could not be decoded as JPEG"),  # cut short
        (bytes(range(256)) * 2, "holds no JPEG frame header"),  # not a JPEG
        (encode_images(_images(1, side=24), 90)[0], "holds an image of 24x24"),  # another size
    ],
)
def test_a_damaged_record_fails_its_batch_naming_the_shard_and_the_record(tmp_path, record, says):
    stream, name = _damaged_split(tmp_path, record)
    assert stream.batch(torch.tensor([0, 1, 2]))[0].shape == (3, 3, SIDE, SIDE)  # the others
    with pytest.raises(ShardError, match=rf"shard \S+{name} record 3 {says}") as error:
        stream.batch(torch.arange(6))  # validation's way
    assert "Run the flow again" in str(error.value)
    batches = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]
    stream.start_epoch(0, batches)
    stream.batch(batches[0])
    with pytest.raises(ShardError, match=rf"{name} record 3 "):  # a planned batch, decoded ahead
        stream.batch(batches[1])
    stream.close()


def test_a_jpeg_shard_whose_offsets_table_is_wrong_is_refused_naming_it(tmp_path):
    encoded = encode_images(_images(4), 90)
    data = bytearray(pack_records(encoded, [0, 1, 2, 3]))
    end = sum(len(e) for e in encoded)
    data[end + 8 : end + 16] = (10**6).to_bytes(8, "little")  # record 0 runs past the records
    name = "ab" * 16 + SUFFIX
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / name).write_bytes(bytes(data))
    info = ShardInfo(name, 4, len(data), zlib.crc32(data))
    index = write_index(str(tmp_path / "o.shards.json"), (3, SIDE, SIDE), (info,), encoding=JPEG)
    with pytest.raises(ShardError, match=rf"jpeg shard \S+{name} does not hold 4 records"):
        ShardStream(index).batch(torch.arange(4))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"encoding": {"kind": "webp", "quality": 90}}, "encoding"),
        ({"encoding": {"kind": "jpeg", "quality": 1000}}, "encoding"),
        ({"record_shape": [9, 16, 16]}, "record_shape"),
        (
            {"shards": [{"name": "cd" * 16 + SUFFIX, "count": 100, "nbytes": 50, "crc32": 0}]},
            "nbytes",
        ),
    ],
)
def test_a_tampered_jpeg_index_is_refused_naming_the_field(tmp_path, change, field):
    _split(tmp_path)
    path = tmp_path / "t.shards.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ShardError, match=rf"shard index .*{field}"):
        read_index(str(path))


def test_frame_size_reads_the_header_of_what_the_encoder_writes():
    [record] = encode_images(_images(1, side=40), 75)
    assert frame_size(record) == (40, 40)
    assert frame_size(np.frombuffer(record, np.uint8)) == (40, 40)
    assert frame_size(b"\xff\xd8\xff\xda") is None
    assert tuple(decode_cpu(np.frombuffer(record, np.uint8).copy()).shape) == (3, 40, 40)


def test_a_cuda_rank_decodes_each_batch_in_one_batched_gpu_call(tmp_path, monkeypatch):
    # No GPU here: decode_cuda (torchvision.io.decode_jpeg(list, device="cuda")) is replaced
    # by one that decodes on CPU and records its calls; what is tested is that a stream
    # given a CUDA device takes that branch, once per batch, with the device it was given.
    index, _ = _split(tmp_path, n=30, per_shard=10)
    calls: list[tuple[int, torch.device]] = []

    def fake_cuda(records, device):  # noqa: ANN001, ANN202
        calls.append((len(records), device))
        return [decode_cpu(r) for r in records]

    monkeypatch.setattr(decoding, "decode_cuda", fake_cuda)
    expected, _ = ShardStream(index).batch(torch.arange(30))
    split = open_split(str(tmp_path / "t.shards.json"), device=torch.device("cuda", 1))
    assert isinstance(split, ShardStream) and split.decoder is not None
    assert split.decoder.on_gpu
    batches = epoch_batches(len(split), 6, 0, 1, 0, 0, order=split.epoch_order)
    split.start_epoch(0, batches)
    for b in batches:
        assert torch.equal(split.batch(b)[0], expected[b])
    split.close()
    assert calls == [(6, torch.device("cuda", 1))] * 5
    # A CPU rank's split decodes on CPU threads; nvJPEG failing a batch names its record.
    assert not open_split(
        str(tmp_path / "t.shards.json"), device=torch.device("cpu")
    ).decoder.on_gpu  # type: ignore[attr-defined]
    stream, name = _damaged_split(tmp_path / "bad", b"\xff\xd8" + bytes(300))
    on_gpu = mock.patch.object(stream.decoder, "device", torch.device("cuda"))
    with on_gpu, pytest.raises(ShardError, match=rf"{name} record 3"):
        stream.batch(torch.arange(6))


def _folder(root) -> str:
    for label, grey in (("dark", 30), ("light", 200)):
        (root / label).mkdir(parents=True)
        for i in range(30):
            (root / label / f"{i:02d}.png").write_bytes(png(grey + i, (20, 12)))
    return str(root)


def test_a_jpeg_format_has_its_own_keys_and_the_raw_formats_images_in_the_same_order(tmp_path):
    folder = _folder(tmp_path / "images")
    spec = ImageSpec(16)

    def plan(encoding: ShardEncoding = RAW):  # noqa: ANN202
        return plan_shards(folder, str(tmp_path / "store"), spec, 0.2, 0, 20, 0.01, encoding)

    raw, jpeg, lower = plan(), plan(JPEG), plan(ShardEncoding("jpeg", 70))
    assert len({raw.key, jpeg.key, lower.key}) == 3
    assert not {c.key for c in raw.chunks} & {c.key for c in jpeg.chunks}
    assert [c.keys for c in raw.chunks] == [c.keys for c in jpeg.chunks]
    assert raw.key == plan_shards(folder, str(tmp_path / "store"), spec, 0.2, 0, 20, 0.01).key
    raw_data, jpeg_data = format_shards(raw, 0.0), format_shards(jpeg, 0.0)
    assert read_index(jpeg_data.train_uri).encoding == JPEG
    # At 16 px a record's tables (about 600 bytes) are most of it: smaller, not by much.
    assert read_index(raw_data.train_uri).nbytes > read_index(jpeg_data.train_uri).nbytes
    a, b = open_split(raw_data.train_uri), open_split(jpeg_data.train_uri)
    (xa, ya), (xb, yb) = a.batch(torch.arange(len(a))), b.batch(torch.arange(len(b)))
    assert torch.equal(ya, yb)
    assert (xa.float() - xb.float()).abs().max() <= 8


def test_the_flows_shard_encoding_reaches_the_format_plan(monkeypatch):
    from flows import train_images
    from flows.params import ImageParams, ParameterError, validate_params

    params = ImageParams(data_layout="shards", shard_encoding="jpeg", jpeg_quality=80)
    submitted = []

    class Stop(Exception):
        pass

    def submit(*args):  # noqa: ANN002, ANN202
        submitted.append(args)
        raise Stop

    monkeypatch.setattr(train_images.plan_image_shards, "submit", submit)
    with pytest.raises(Stop):
        train_images._format_as_shards(
            params, SimpleNamespace(artifact_root="/tmp/a"), "/tmp/src", ImageSpec(16)
        )
    assert submitted[0][-1] == ShardEncoding("jpeg", 80)
    with pytest.raises(ParameterError, match="jpeg_quality=20: .* 50"):
        validate_params(ImageParams, {"jpeg_quality": 20})
