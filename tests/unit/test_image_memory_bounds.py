"""Image formatting holds a bounded amount in memory: bytes in flight, pixels per image.

Object-store reads are batched by listed bytes, not by a count of objects of any size; the
per-image cap (max_image_mb) has an upper bound the budget holds; and an image whose header
promises more pixels than the model input can use (a decompression bomb: a few KB of PNG
that decodes to gigabytes) is refused before it is decoded. Real PNG files, real folders
and fsspec's in-memory filesystem as the object store.
"""

from __future__ import annotations

import io
from pathlib import Path

import fsspec
import pytest
from PIL import Image

from ddpflow.workloads.vision.data import ImageSpec, format_image_folder
from ddpflow.workloads.vision.image_folder import (
    MIN_PIXEL_LIMIT,
    DatasetError,
    list_image_folder,
    pixel_limit,
)
from ddpflow.workloads.vision.objects import (
    MAX_IMAGE_MB,
    MAX_READS_IN_FLIGHT,
    READ_BUDGET_BYTES,
    BadObject,
    read_batches,
    read_objects,
)
from flows.params import ImageParams, ParameterError, validate_params
from tests.helpers.pngs import png
from tests.helpers.within import outcome_within
from tests.unit.test_vision_params import VALID

pytestmark = pytest.mark.timeout(120)
MiB = 2**20


def bomb(side: int = 5000) -> bytes:
    """A one-colour PNG of side x side pixels: ~25 KB that decodes to side^2 bytes."""
    buffer = io.BytesIO()
    Image.new("L", (side, side), 0).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def folder(root: Path, files: dict[str, bytes]) -> str:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return str(root)


def test_the_pixel_limit_follows_image_size() -> None:
    assert pixel_limit(32) == MIN_PIXEL_LIMIT == 2**24  # a 16.8-megapixel photo still decodes
    assert pixel_limit(1024) == 8192**2
    assert pixel_limit(224) < Image.MAX_IMAGE_PIXELS  # below PIL's own ~179 M


def test_a_decompression_bomb_is_refused_before_decoding(tmp_path: Path) -> None:
    data = bomb()
    assert len(data) < 100_000  # small on disk: the cap on file size alone lets it through
    good = {f"{c}/{i}.png": png(10 * i + c) for c in (1, 2) for i in range(3)}
    root = folder(tmp_path / "imgs", {**good, "1/bomb.png": data})
    result = outcome_within(
        60, lambda: format_image_folder(root, str(tmp_path / "art"), ImageSpec(8), 0.34, 0, 0.5)
    )
    assert not isinstance(result, BaseException), result
    (bad,) = result.bad_images
    assert bad.key == "1/bomb.png"
    assert bad.reason.startswith("DecompressionBombError: 5000x5000 pixels, over the limit")
    assert "16,777,216" in bad.reason and "downscale it or raise image_size" in bad.reason
    # Where no bad image is tolerated, the run fails naming the file and why.
    with pytest.raises(DatasetError, match=r"1/bomb\.png \(DecompressionBombError: 5000x5000"):
        format_image_folder(root, str(tmp_path / "art2"), ImageSpec(8), 0.34, 0, 0.0)


def test_reads_are_batched_by_bytes_not_by_count() -> None:
    cap = 20 * MiB
    big = [f"c/{i}.jpg" for i in range(100)]
    batches = list(read_batches(big, dict.fromkeys(big, cap), cap))
    assert max(len(b) for b in batches) == READ_BUDGET_BYTES // (cap + 1)  # 12, not 256
    assert [k for b in batches for k in b] == big  # every key once, in order
    small = [f"c/{i}.png" for i in range(1000)]
    batches = list(read_batches(small, dict.fromkeys(small, 1000), cap))
    assert [len(b) for b in batches] == [MAX_READS_IN_FLIGHT] * 3 + [1000 - 3 * 256]
    # Unknown sizes count as the cap; an object over the budget is read alone.
    assert max(len(b) for b in read_batches(small, {}, cap)) == 12
    huge_cap = int(MAX_IMAGE_MB * MiB)
    assert [len(b) for b in read_batches(big[:3], {}, huge_cap)] == [1, 1, 1]


def test_an_object_rewritten_larger_since_the_listing_is_cut_off() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe({"/bounds/c/a.png": png(1), "/bounds/c/b.png": b"x" * (3 * MiB)})
    try:
        # The listing said 1 KB each; b.png has since grown past the 1 MiB cap.
        out = dict(read_objects("memory://bounds", ["c/a.png", "c/b.png"], MiB, {}))
        assert out["c/a.png"] == png(1)
        assert isinstance(out["c/b.png"], BadObject)
        assert "over the per-image cap of 1 MiB" in out["c/b.png"].reason
        assert f"{MiB + 1} bytes" in out["c/b.png"].reason  # read up to the cap + 1, not 3 MiB
    finally:
        fs.rm("/bounds", recursive=True)


def test_max_image_mb_has_an_upper_bound(tmp_path: Path) -> None:
    with pytest.raises(
        ParameterError, match=f"max_image_mb=1024: .* less than or equal to {MAX_IMAGE_MB:g}$"
    ):
        validate_params(ImageParams, {**VALID, "max_image_mb": 1024})
    assert validate_params(ImageParams, {**VALID, "max_image_mb": MAX_IMAGE_MB}).max_image_mb == 256
    root = folder(tmp_path / "imgs", {"a/0.png": png(1), "b/0.png": png(2)})
    with pytest.raises(ValueError, match="max_image_mb=1024 is not above 0 and at most 256"):
        list_image_folder(root, 1024)
    assert MAX_IMAGE_MB * MiB <= READ_BUDGET_BYTES  # one image at the cap fits the budget


def test_objects_grown_since_the_listing_put_no_more_bytes_in_flight_than_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """64 objects listed at 1,000 bytes each grew to 200 KB (under the cap) before they were
    read: one batch's reads hold what the listing planned (64 x 1,001 bytes), not 64 x the
    grown size; each grown object is then read alone, whole."""
    fs = fsspec.filesystem("memory")
    keys = [f"c/{i}.png" for i in range(64)]
    grown = b"g" * (200 * 1000)
    fs.pipe({f"/grow/{key}": grown for key in keys})
    in_flight: list[int] = []  # bytes each batched read returned at once

    def counting(method):
        def read(*args, **kwargs):
            found = method(*args, **kwargs)
            values = found.values() if isinstance(found, dict) else found
            in_flight.append(sum(len(data) for data in values if isinstance(data, bytes)))
            return found

        return read

    monkeypatch.setattr(fs, "cat_ranges", counting(fs.cat_ranges))
    monkeypatch.setattr(fs, "cat", counting(fs.cat))
    try:
        out = dict(read_objects("memory://grow", keys, MiB, dict.fromkeys(keys, 1000)))
        assert in_flight == [64 * 1001], in_flight
        assert all(out[key] == grown for key in keys)
    finally:
        fs.rm("/grow", recursive=True)
