"""JPEG records: encoded once by the format step, decoded on the rank, checked first.

torchvision.io's libjpeg-turbo does both (the stack has it; PIL's would do too, but
torchvision decodes straight into a tensor and, on a CUDA rank, with nvJPEG). Before a record
is decoded its frame header is read (`frame_size`): a record whose image is not the size the
index lists is refused by its header, so bytes that passed the shard's CRC but are not what
formatting wrote can never make the decoder allocate an image of their choosing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Start-of-frame markers carry the image's height and width: SOF0-SOF15 but for DHT (C4),
# JPG (C8) and DAC (CC), which share the range.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_SOS, _EOI = 0xDA, 0xD9
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])  # TEM and RSTn: no length field


def encode_images(images: np.ndarray, quality: int) -> list[bytes]:
    """uint8 images [n, 3, H, W] as JPEG files of `quality`, one each."""
    import torch
    from torchvision.io import encode_jpeg

    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(
            f"jpeg records must be uint8 [n, 3, H, W] images, got {images.dtype} "
            f"{tuple(images.shape)}"
        )
    tensors = torch.from_numpy(np.ascontiguousarray(images))
    return [encode_jpeg(image, quality=quality).numpy().tobytes() for image in tensors]


def frame_size(record: np.ndarray | bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) from a JPEG's frame header, or None when there is none before the
    image data (not a JPEG, or a damaged one). Walks the marker segments only."""
    data = record.data if isinstance(record, np.ndarray) else record  # 1-D uint8: ints
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:  # SOI
        return None
    at = 2
    while at + 4 <= n:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte before a marker
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        if marker in (_SOS, _EOI):
            return None  # image data, or the end, before any frame header
        length = (data[at + 2] << 8) | data[at + 3]
        if marker in _SOF:
            if at + 9 > n:
                return None
            return (data[at + 5] << 8) | data[at + 6], (data[at + 7] << 8) | data[at + 8]
        at += 2 + length
    return None


def decode_cpu(record: np.ndarray) -> torch.Tensor:
    """One record as a uint8 RGB tensor [3, H, W]; RuntimeError from libjpeg when damaged.
    torchvision's decode releases the GIL, so threads decode side by side (measured,
    decoding alone: 2 threads 1.9x one on 2 free cores)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(torch.from_numpy(record), mode=ImageReadMode.RGB)


def decode_cuda(records: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The records decoded on a CUDA `device` in one batched nvJPEG call (torchvision's
    decode_jpeg(list, device=...)); RuntimeError when any is damaged. The caller's thread
    waits for the decode to finish, so the tensors are ready for any stream."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = [torch.from_numpy(r) for r in records]
    images = decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
    torch.cuda.current_stream(device).synchronize()
    return list(images)
