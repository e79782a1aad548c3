"""An image folder over any fsspec root, `<root>/<class>/<image>`, listed with one call.

Classes and sample order match torchvision's ImageFolder (class folders sorted by name,
images with an image extension found recursively, sorted folder by folder), so a model
trained here has the class indices a torchvision user expects. Listing and reading go
through ddpflow.workloads.vision.objects (regular files inside the folder only, each under a size
cap) and images are decoded from bytes with PIL, so no file handle outlives a call and
nothing here needs a forked process.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ddpflow import storage
from ddpflow.storage.redact import redact_url
from ddpflow.workloads.vision.objects import (
    DEFAULT_MAX_IMAGE_MB,
    MAX_IMAGE_MB,
    list_objects,
    mb_to_bytes,
)

MAX_KEYS_SHOWN = 10
# decode_image's pixel limit (pixel_limit()): a 16.8-megapixel photo decodes at any image_size.
MIN_PIXEL_LIMIT = 2**24
PIXEL_LIMIT_FACTOR = 8
# torchvision's ImageFolder extensions (torchvision.datasets.folder.IMG_EXTENSIONS), written
# out so that listing a folder in the flow process does not import torch.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class DatasetError(ValueError):
    """The image folder cannot be trained on; the message names the root and what is wrong."""


@dataclass(frozen=True)
class BadImage:
    key: str
    reason: str


@dataclass(frozen=True)
class ImageIndex:
    """One listing of an image folder: classes, samples and what was left out."""

    root: str
    classes: list[str]
    samples: list[tuple[str, int]]  # (key relative to root, class index)
    ignored: list[str]  # files in class folders without an image extension
    fingerprint: str  # changes when any listed file is added, removed or rewritten
    skipped: list[BadImage] = field(default_factory=list)  # image entries never read
    max_image_bytes: int = mb_to_bytes(DEFAULT_MAX_IMAGE_MB)
    sizes: dict[str, int] = field(default_factory=dict)  # listed size of each sample
    # Each sample's version as listed (ETag on S3, mtime locally): with its size, what
    # tells a rewritten file (shard_format keys its chunks with them).
    versions: dict[str, str] = field(default_factory=dict)

    def uri(self, key: str) -> str:
        return storage.join(self.root, key)


def list_image_folder(root: str, max_image_mb: float = DEFAULT_MAX_IMAGE_MB) -> ImageIndex:
    """List `<root>/<class>/...` once; a folder with < 2 classes or an empty class is an error.

    Entries that must not be read (not a regular file, a symlink out of the folder, over
    `max_image_mb`) are kept out of the samples and reported in `skipped` with the reason.
    """
    if not 0 < max_image_mb <= MAX_IMAGE_MB:
        raise ValueError(
            f"max_image_mb={max_image_mb:g} is not above 0 and at most {MAX_IMAGE_MB:g} "
            "(MiB per image file); pass e.g. 20"
        )
    max_bytes = mb_to_bytes(max_image_mb)
    listing = list_objects(root, max_bytes)
    if listing.linked_classes:
        raise DatasetError(
            f"class folder(s) {', '.join(map(repr, listing.linked_classes))} under "
            f"{redact_url(root)} are symlinks, which are not followed (they could lead "
            "outside the folder); copy or bind-mount the images into the folder"
        )
    return _build_index(root, sorted(listing.class_dirs), listing.files, max_bytes)


def _build_index(
    root: str, classes: list[str], files: dict[str, dict[str, Any]], max_bytes: int
) -> ImageIndex:
    shown = redact_url(root)
    if not classes:
        raise DatasetError(
            f"no class folders under {shown}: expected <root>/<class>/<image> "
            "(does the folder exist?)"
        )
    if len(classes) < 2:
        raise DatasetError(
            f"{shown} has only one class folder ({classes[0]!r}); classification needs at "
            "least 2 classes (<root>/<class>/<image>)"
        )
    class_to_index = {name: i for i, name in enumerate(classes)}
    # torchvision walks each class folder sorted by directory, then by file name.
    ordered = sorted(files, key=lambda k: (k.rsplit("/", 1)[0], k.rsplit("/", 1)[1]))
    images = [k for k in ordered if k.lower().endswith(IMG_EXTENSIONS)]
    readable = [k for k in images if not files[k]["problem"]]
    samples = [(k, class_to_index[k.split("/", 1)[0]]) for k in readable]
    skipped = [BadImage(k, files[k]["problem"]) for k in images if files[k]["problem"]]
    labels = [class_to_index[k.split("/", 1)[0]] for k in images]
    check_classes_have_images(shown, classes, labels, "no image files")
    image_set = set(images)
    ignored = [_with_problem(k, files[k]) for k in ordered if k not in image_set]
    fingerprint = _fingerprint(images, files)
    sizes = {k: int(files[k].get("size") or 0) for k in readable}
    versions = {k: _version(files[k]) for k in readable}
    return ImageIndex(
        root, classes, samples, ignored, fingerprint, skipped, max_bytes, sizes, versions
    )


def _with_problem(key: str, info: dict[str, Any]) -> str:
    return f"{key} ({info['problem']})" if info.get("problem") else key


def check_classes_have_images(
    shown_root: str, classes: Sequence[str], labels: Sequence[int], what: str
) -> None:
    """Every class needs at least one image, or its index would never be trained."""
    present = set(labels)
    empty = [name for i, name in enumerate(classes) if i not in present]
    if empty:
        raise DatasetError(
            f"class folder(s) {', '.join(map(repr, empty))} under {shown_root} have {what} "
            f"(extensions: {', '.join(IMG_EXTENSIONS)}); add images or remove the folder"
        )


def _fingerprint(keys: list[str], files: dict[str, dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for key in keys:
        info = files[key]
        digest.update(f"{key}\0{info.get('size')}\0{_version(info)}\n".encode())
    return digest.hexdigest()


def _version(info: dict[str, Any]) -> str:
    # ETag on S3, mtime locally: a rewritten file of the same size still changes it.
    return str(info.get("ETag") or info.get("mtime") or "")


def pixel_limit(image_size: int) -> int:
    """The most pixels an image may decode to when it is resized to `image_size`.

    (8 x image_size)^2, and at least MIN_PIXEL_LIMIT: room for photos far larger than the
    model input, while a decompression bomb (a few KB of PNG that decodes to gigabytes) is
    refused. PIL's own limit, ~179 M pixels (537 MB as RGB) whatever the model needs, is far
    above what any image_size here uses.
    """
    return max(MIN_PIXEL_LIMIT, (PIXEL_LIMIT_FACTOR * image_size) ** 2)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """An RGB PIL image from encoded bytes; raises for anything PIL cannot fully decode.

    Image.DecompressionBombError for more than `max_pixels`, checked on the header,
    before any pixel is decoded.
    """
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        if width * height > max_pixels:
            raise Image.DecompressionBombError(
                f"{width}x{height} pixels, over the limit of {max_pixels:,} (8 x image_size "
                "squared, at least 16.8 M): a decompression bomb or an oversized image; "
                "downscale it or raise image_size"
            )
        image.load()  # decode now: a truncated file fails here, not in a training step
        return image.convert("RGB")


def check_bad_share(
    shown_root: str, num_files: int, bad: Sequence[BadImage], max_bad_fraction: float
) -> None:
    """Fail when more than `max_bad_fraction` of the image files could not be decoded."""
    share = len(bad) / max(1, num_files)
    if share > max_bad_fraction:
        raise DatasetError(
            f"{len(bad)} of {num_files} image files under {shown_root} ({share:.1%}) could "
            f"not be read, more than max_bad_fraction={max_bad_fraction:g}: "
            f"{describe_keys(shown_root, bad)}. Fix or remove them, or raise max_bad_fraction"
        )


def describe_keys(shown_root: str, bad: Sequence[BadImage]) -> str:
    shown = [f"{storage.join(shown_root, b.key)} ({b.reason})" for b in bad[:MAX_KEYS_SHOWN]]
    more = len(bad) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
