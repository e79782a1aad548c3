"""Format an image folder once into uint8 tensors in the artifact store, split for training.

Every image is read and decoded once, resized to `image_size` and stored as uint8
[N, 3, S, S] tensors (train and validation), so ranks slice tensors instead of opening and
decoding files every epoch: no per-item Dataset, no loader processes, no s3fs in forked
children. The trade-off is memory: each rank holds its split, 3 * S * S bytes per image
(3 KB at 32 px, 150 KB at 224 px), which suits folders up to a few GB formatted; larger
ones are streamed from shards (ddpflow.workloads.vision.shard_format). Like the char-LM's
formatted corpus, the output is keyed by the folder's fingerprint and the format settings,
and a rerun reuses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from PIL import Image

from ddpflow import storage
from ddpflow.shards.settings import StreamSettings
from ddpflow.storage.redact import redact_url
from ddpflow.workloads.vision.image_folder import (
    BadImage,
    DatasetError,
    ImageIndex,
    check_bad_share,
    check_classes_have_images,
    decode_image,
    list_image_folder,
    pixel_limit,
)
from ddpflow.workloads.vision.objects import DEFAULT_MAX_IMAGE_MB, BadObject, read_objects
from ddpflow.workloads.vision.split import stratified_split

# 2: reads that failed for network reasons were cached as unreadable by version 1; such
# manifests must not be trusted, and the per-image size cap is part of the key.
if TYPE_CHECKING:
    import torch

    from ddpflow.training.samples import Samples

    Transform = Callable[[Image.Image], torch.Tensor]

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
# A manifest lists the bad and ignored files by name: 64 MiB is a few hundred thousand.
MANIFEST_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ImageSpec:
    """How every image is turned into a tensor at format time."""

    image_size: int
    # "crop": shorter side to image_size, then a centre square (keeps the aspect ratio, as
    # the transfer-learning tutorial's Resize + CenterCrop); "stretch": both sides to image_size.
    resize: Literal["crop", "stretch"] = "crop"

    def transform(self) -> Transform:
        """PIL RGB image -> uint8 tensor [3, S, S] (torchvision v2 transforms)."""
        # torch and torchvision are imported where used in this module: the flow process
        # imports it for its settings and result types and starts without torch.
        import torchvision.transforms.v2 as T

        size = self.image_size
        if self.resize == "stretch":
            return T.Compose([T.PILToTensor(), T.Resize((size, size), antialias=True)])
        return T.Compose([T.PILToTensor(), T.Resize(size, antialias=True), T.CenterCrop(size)])


@dataclass(frozen=True)
class FormattedImages:
    """Where the formatted splits are, and what listing and decoding found."""

    train_uri: str
    val_uri: str
    val_keys_uri: str
    classes: list[str]
    num_train: int
    num_val: int
    image_size: int
    fingerprint: str
    num_files: int
    bad: list[dict[str, str]] = field(default_factory=list)  # {"key", "reason"}
    ignored: list[str] = field(default_factory=list)
    reused: bool = False

    @property
    def bad_images(self) -> list[BadImage]:
        return [BadImage(**b) for b in self.bad]


@dataclass(frozen=True)
class ImageSplit:
    """One split in memory: uint8 images [N, 3, S, S] and int64 labels [N]."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def format_image_folder(
    root: str,
    artifact_root: str,
    spec: ImageSpec,
    val_fraction: float,
    seed: int,
    max_bad_fraction: float,
    max_image_mb: float = DEFAULT_MAX_IMAGE_MB,
) -> FormattedImages:
    """List, decode, split and store `root`; bad input fails here, before anything is written.

    Entries the listing rules out (not a regular file, outside the folder, too large) and
    images that do not decode are `bad`; a read that fails for any other reason raises
    ImageReadError, so nothing is stored that a rerun would trust.
    """
    index = list_image_folder(root, max_image_mb)
    cap = index.max_image_bytes
    settings = f"{index.fingerprint}-v{FORMAT_VERSION}-{spec}-{val_fraction:g}-{seed}-{cap}"
    key = storage.sha256_hex(settings.encode())[:16]
    folder = storage.join(artifact_root, "data", "images", key)
    manifest_uri = storage.join(folder, MANIFEST)
    if storage.exists(manifest_uri):
        stored = json.loads(storage.read_bytes(manifest_uri, MANIFEST_MAX_BYTES))
        result = FormattedImages(**{**stored, "reused": True})
        # The share is checked again: it depends on this run's max_bad_fraction.
        check_bad_share(redact_url(root), result.num_files, result.bad_images, max_bad_fraction)
        return result
    keys, images, labels, bad = decode_all(index, spec.transform(), pixel_limit(spec.image_size))
    bad = sorted([*index.skipped, *bad], key=lambda b: b.key)
    num_files = len(index.samples) + len(index.skipped)
    check_bad_share(redact_url(root), num_files, bad, max_bad_fraction)
    check_classes_have_images(redact_url(root), index.classes, labels, "no readable image")
    train, val = stratified_split(keys, labels, val_fraction, seed)
    if not val:
        raise DatasetError(
            f"{redact_url(root)} has no class with 2 or more readable images, so nothing can "
            "be held out for validation; add images"
        )
    result = FormattedImages(
        train_uri=storage.join(folder, "train.pt"),
        val_uri=storage.join(folder, "val.pt"),
        val_keys_uri=storage.join(folder, "val_keys.json"),
        classes=index.classes,
        num_train=len(train),
        num_val=len(val),
        image_size=spec.image_size,
        fingerprint=index.fingerprint,
        num_files=num_files,
        bad=[asdict(b) for b in bad],
        ignored=index.ignored,
    )
    _save(result, images, labels, train, val, [keys[i] for i in val])
    storage.write_bytes(manifest_uri, json.dumps(asdict(result)).encode())  # last: complete
    return result


def decode_all(
    index: ImageIndex, transform: Transform, max_pixels: int
) -> tuple[list[str], list[torch.Tensor], list[int], list[BadImage]]:
    """Decode every sample in the main process; collect the unreadable ones with their keys."""
    labels_by_key = dict(index.samples)
    sample_keys = [k for k, _ in index.samples]
    keys, images, bad = decode_images(
        index.root, sample_keys, index.max_image_bytes, index.sizes, transform, max_pixels
    )
    return keys, images, [labels_by_key[k] for k in keys], bad


def decode_images(
    root: str,
    keys: Sequence[str],
    max_bytes: int,
    sizes: Mapping[str, int],
    transform: Transform,
    max_pixels: int,
) -> tuple[list[str], list[torch.Tensor], list[BadImage]]:
    """(decoded keys, their tensors, the unreadable ones with the reason) of `keys` under
    `root`; a read that fails for another reason raises (objects.read_objects)."""
    decoded: list[str] = []
    images: list[torch.Tensor] = []
    bad: list[BadImage] = []
    for key, data in read_objects(root, keys, max_bytes, sizes):
        if isinstance(data, BadObject):
            bad.append(BadImage(key, data.reason))
            continue
        try:
            tensor = transform(decode_image(data, max_pixels))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            # PIL raises these for truncated, corrupt and non-image bytes.
            bad.append(BadImage(key, f"{type(error).__name__}: {error}"[:200]))
            continue
        decoded.append(key)
        images.append(tensor)
    return decoded, images, bad


def _save(
    result: FormattedImages,
    images: list[torch.Tensor],
    labels: list[int],
    train: list[int],
    val: list[int],
    val_keys: list[str],
) -> None:
    import torch

    stacked = torch.stack(images)
    label_tensor = torch.tensor(labels, dtype=torch.int64)
    for uri, rows in ((result.train_uri, train), (result.val_uri, val)):
        index = torch.tensor(rows, dtype=torch.int64)
        storage.save_torch(uri, {"images": stacked[index], "labels": label_tensor[index]})
    storage.write_bytes(result.val_keys_uri, json.dumps(val_keys).encode())


def load_split(uri: str) -> ImageSplit:
    data = storage.load_torch(uri)
    return ImageSplit(images=data["images"], labels=data["labels"])


def open_split(
    uri: str,
    stream: StreamSettings | None = None,
    on_wait: Callable[[], None] | None = None,
    device: torch.device | None = None,
) -> Samples:
    """A formatted split: held in memory (a `.pt` file, format_image_folder) or streamed from
    its shards (a `.shards.json` index, ddpflow.workloads.vision.shard_format) as `stream`
    says, calling `on_wait` while a batch waits for its shard (ddpflow.shards.stream). The
    records of compressed shards are decoded on the rank's `device` when it is a GPU (its
    batches' images are then on it), else by CPU threads."""
    from ddpflow.shards.index import is_index_uri, read_index

    if not is_index_uri(uri):
        return load_split(uri)
    from ddpflow.shards.stream import ShardStream

    stream = stream or StreamSettings()
    return ShardStream(
        read_index(uri),
        stream.window,
        stream.prefetch,
        on_wait,
        stream.read_bound_s,
        requests_in_flight=stream.requests_in_flight,
        max_bytes_in_flight=stream.max_bytes_in_flight,
        chunk_bytes=stream.chunk_bytes,
        decode_threads=stream.decode_threads,
        decode_ahead=stream.decode_ahead,
        decode_device=device if device is not None and device.type == "cuda" else None,
    )
