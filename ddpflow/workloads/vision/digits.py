"""Offline demo data: scikit-learn's digits written out as a PNG image folder.

1,797 real 8x8 grayscale scans of handwritten digits in 10 classes, shipped inside
scikit-learn, so the image workload runs with no network. Files stay 8x8 grayscale; the
format step resizes them and makes 3 channels like any other folder.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ddpflow import storage
from ddpflow.cluster.extras import missing_extra

MARKER = "_digits.json"  # at the top level, which image-folder listings ignore
MARKER_MAX_BYTES = 2**16  # two numbers


@dataclass(frozen=True)
class DigitsFolder:
    uri: str
    num_images: int
    num_classes: int
    written: bool  # False when a complete copy was already there


def digits_pngs() -> dict[str, bytes]:
    """`<class>/<i>.png` -> PNG bytes for every digits image (pixel values 0-16 -> 0-255)."""
    # scikit-learn ships the data; it is the `digits` extra, not a library requirement.
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise missing_extra("digits", "the digits demo data (digits_pngs)", error) from None

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).clip(0, 255).astype(np.uint8)
    files = {}
    for i, (image, label) in enumerate(zip(pixels, digits.target, strict=True)):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")  # 2-D uint8: grayscale ("L")
        files[f"{int(label)}/{i:04d}.png"] = buffer.getvalue()
    return files


def write_digits(root: str) -> DigitsFolder:
    """Write the digits folder under `root` (any fsspec URI), then its completion marker."""
    files = digits_pngs()
    fs, base = storage.url_to_fs(root)
    base = base.rstrip("/")
    for label in sorted({key.split("/", 1)[0] for key in files}):
        fs.makedirs(f"{base}/{label}", exist_ok=True)  # local folders must exist; S3: no-op
    # One concurrent bulk upload (s3fs) instead of 1,797 sequential PUTs.
    fs.pipe({f"{base}/{key}": data for key, data in files.items()})
    num_classes = len({key.split("/", 1)[0] for key in files})
    marker = {"num_images": len(files), "num_classes": num_classes}
    storage.write_bytes(storage.join(root, MARKER), json.dumps(marker).encode())
    return DigitsFolder(root, len(files), num_classes, written=True)


def ensure_digits(root: str) -> DigitsFolder:
    """The digits folder at `root`, written only when no complete copy is there yet."""
    marker_uri = storage.join(root, MARKER)
    if storage.exists(marker_uri):
        marker = json.loads(storage.read_bytes(marker_uri, MARKER_MAX_BYTES))
        return DigitsFolder(root, marker["num_images"], marker["num_classes"], written=False)
    return write_digits(root)
