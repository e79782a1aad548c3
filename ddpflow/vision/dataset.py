"""A per-item Dataset over an image folder, for folders too large to format into memory.

The flow formats folders into tensors (data.py): for small and mid-sized folders that is
faster on CPU, since nothing is decoded twice. This is the other path: each item is read
and decoded when it is asked for, in the main process or in DataLoader workers started
with the *spawn* context. s3fs is not fork-safe (a forked child inherits its event loop
and connections in an unusable state), and Dask workers need
`distributed.worker.daemon=False` (ddpflow.cluster sets it) to start loader processes.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ddpflow.vision.data import Transform
from ddpflow.vision.image_folder import DatasetError, ImageIndex, decode_image
from ddpflow.vision.objects import BadObject, read_objects


class ImageFolderDataset(Dataset):
    """(image tensor, class index) per sample of `index`, restricted to `indices`."""

    def __init__(
        self, index: ImageIndex, transform: Transform, indices: Sequence[int] | None = None
    ):
        self.index = index
        self.transform = transform
        self.indices = list(range(len(index.samples)) if indices is None else indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        key, label = self.index.samples[self.indices[i]]
        # Same rules as formatting: regular files inside the folder, under the size cap,
        # transient errors retried.
        _, data = next(read_objects(self.index.root, [key], self.index.max_image_bytes))
        try:
            if isinstance(data, BadObject):
                raise ValueError(data.reason)
            return self.transform(decode_image(data)), label
        except (OSError, SyntaxError, ValueError) as error:
            raise DatasetError(f"cannot read {self.index.uri(key)}: {error}") from error


def spawn_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int = 0,
    sampler: Sampler | None = None,
    shuffle: bool = False,
) -> DataLoader:
    """A DataLoader whose worker processes (if any) are spawned, never forked."""
    context = multiprocessing.get_context("spawn") if num_workers > 0 else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle if sampler is None else False,
        sampler=sampler,
        num_workers=num_workers,
        multiprocessing_context=context,
        persistent_workers=num_workers > 0,  # spawning costs seconds; do it once per run
    )
