"""A rank's decoder of compressed records: a batch's encoded images in, uint8 images out.

On CPU, records are decoded one by one with torchvision's libjpeg-turbo, each checked first
by its frame header (ddpflow.shards.jpeg.frame_size), and the stream (ddpflow.shards.stream)
runs whole batches on this decoder's pool of `threads`, ahead of the batch in use, so the
training thread only waits when decoding is slower than its steps. On a CUDA device the
batch is decoded in one nvJPEG call (torchvision.io.decode_jpeg(list, device=...)), and the
images come back on that device.

A record that does not decode is a ShardError naming the shard and the record, never a
skipped sample: the shard's bytes passed their CRC-32, so such a record was written damaged.
The same bytes decode to the same pixels on CPU every time, so a resumed run sees what the
interrupted one saw; nvJPEG's pixels may differ from libjpeg's by a level or so, and are the
same run to run on the same GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ddpflow.shards.jpeg import decode_cpu, decode_cuda, frame_size
from ddpflow.shards.shard_file import REFORMAT_HINT, ShardError

T = TypeVar("T")


@dataclass(frozen=True)
class RecordAt:
    """Where an encoded record is from: its shard (redacted URI) and number there."""

    shard: str
    record: int


class RecordDecoder:
    """Decodes batches of jpeg records to uint8 [n, *shape], on `device` (CPU or CUDA)."""

    def __init__(
        self, shape: tuple[int, ...], threads: int, device: torch.device | str | None = None
    ) -> None:
        self.shape = tuple(shape)
        self.device = torch.device(device or "cpu")
        self.threads = threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started by the first decode, ended by close

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def submit(self, work: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ddpflow-decode")
            return self._pool.submit(work, *args)

    def decode(self, records: Sequence[np.ndarray], where: Sequence[RecordAt]) -> torch.Tensor:
        """The records as uint8 [n, *shape] on the device, in this thread."""
        for data, at in zip(records, where, strict=True):
            self._check_header(data, at)
        if self.on_gpu:
            return self._decode_on_gpu(records, where)
        out = torch.empty((len(records), *self.shape), dtype=torch.uint8)
        for i, (data, at) in enumerate(zip(records, where, strict=True)):
            out[i] = self._decode_one(data, at)
        return out

    def decode_spread(
        self, records: Sequence[np.ndarray], where: Sequence[RecordAt]
    ) -> torch.Tensor:
        """decode, the records cut into one part per thread of the pool (for a batch
        outside the epoch's plan, which nothing decoded ahead); the caller waits."""
        if self.on_gpu or self.threads == 1 or len(records) < 2 * self.threads:
            return self.decode(records, where)
        cuts = np.linspace(0, len(records), self.threads + 1).astype(int)
        parts = [
            self.submit(self.decode, records[lo:hi], where[lo:hi])
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
        ]
        return torch.cat([part.result() for part in parts])

    def _check_header(self, data: np.ndarray, at: RecordAt) -> None:
        size = frame_size(data)
        if size != self.shape[1:]:
            found = "no JPEG frame header" if size is None else f"an image of {size[0]}x{size[1]}"
            raise ShardError(
                f"shard {at.shard} record {at.record} holds {found}, not the "
                f"{self.shape[1]}x{self.shape[2]} JPEG the index lists: it was written damaged "
                f"or by something else than ddpflow's formatting. {REFORMAT_HINT}"
            )

    def _decode_one(self, data: np.ndarray, at: RecordAt) -> torch.Tensor:
        try:
            image = decode_cpu(data)
        except RuntimeError as error:  # libjpeg's error, with torchvision's source line
            raise ShardError(
                f"shard {at.shard} record {at.record} could not be decoded as JPEG "
                f"({str(error).splitlines()[0][-160:]}): its bytes passed the shard's CRC-32, "
                f"so the record was written damaged. {REFORMAT_HINT}"
            ) from error
        if tuple(image.shape) != self.shape:
            raise ShardError(
                f"shard {at.shard} record {at.record} decodes to {tuple(image.shape)}, not the "
                f"{self.shape} the index lists. {REFORMAT_HINT}"
            )
        return image

    def _decode_on_gpu(
        self, records: Sequence[np.ndarray], where: Sequence[RecordAt]
    ) -> torch.Tensor:
        try:
            images = decode_cuda(records, self.device)
        except RuntimeError:
            # nvJPEG fails the whole batch: find the record on CPU, to name it.
            for data, at in zip(records, where, strict=True):
                self._decode_one(data, at)
            raise
        return torch.stack(images)

    def close(self) -> None:
        """Stop: decodes not started are dropped, running ones finish on their own (a later
        decode starts a new pool)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
