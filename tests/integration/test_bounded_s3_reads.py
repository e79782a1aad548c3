"""Bounded reads against a real S3 API (a SeaweedFS server over HTTP, s3fs as in production).

The unit tests use fsspec's in-memory store; this checks what only a real S3 client shows:
ranged reads (an object rewritten larger since the listing is cut off at the cap plus one
byte, an empty object is never asked for a range S3 cannot serve), the batch deadline
passed to s3fs, and the cap and kind checks of a single read.
"""

from __future__ import annotations

import pytest

from ddpflow import storage
from ddpflow.storage.capped_read import ReadRefused, TooLarge
from ddpflow.workloads.vision.data import ImageSpec, format_image_folder
from ddpflow.workloads.vision.objects import BadObject, read_objects
from tests.helpers.pngs import png
from tests.helpers.s3_servers import s3_client, use_s3

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
