"""Format an image folder into shards on the cluster: plan chunks, decode each on a worker,
index them. For folders too large to hold in every rank (ddpflow.workloads.vision.data holds
them in memory).

1. `plan_shards` (one process) lists the folder, splits it as the in-memory path does
   (split.stratified_split: per class, by a seeded hash of each key) and cuts each split
   into chunks. Files are ordered by a hash of their key, so a chunk mixes the classes, and
   a chunk ends where a key's hash says so (content-defined, as rsync and restic cut
   files): adding or removing files changes the chunks around them, not every chunk after.
2. `format_chunk` (one per chunk, anywhere on the cluster) reads and decodes at most one
   chunk of images and writes them as one shard (ddpflow.shards.shard_file), then a small
   record of the chunk named by its content key: the key covers each file's name, size and
   version, its class, the format settings and FORMAT_VERSION, so a rerun finds the record
   and does not decode that chunk again, wherever it is scheduled.
3. `index_shards` (one process) checks the unreadable share and the classes, writes each
   split's index (ddpflow.shards.index) and the manifest, last.

With a jpeg encoding (ddpflow.shards.encoding) each decoded, resized image is compressed on
its own by the chunk's worker at the chosen quality; the encoding and quality are part of
every cache key (chunk records and manifests), so a raw and a jpeg format of one folder are
two formats, and raw keys are those written before there was a choice. A chunk holds the
same images whatever the encoding (its size is counted in decoded bytes), so both formats
of a folder have the same shards' counts, the same order and the same batches.

Every store path is under `<artifact_root>/data/image-shards/`: `shards/`, `chunks/`, and
per formatted folder `<key>.json` (the manifest) with `<key>-train.shards.json` and
`<key>-val.shards.json`. Shards and chunk records are shared by every format of every folder:
a changed folder reuses the chunks it still has.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from ddpflow import storage
from ddpflow.shards.encoding import RAW, ShardEncoding
from ddpflow.shards.index import SHARDS_FOLDER, shards_present, write_index
from ddpflow.shards.shard_file import ShardInfo, write_shard
from ddpflow.storage.redact import redact_url
from ddpflow.workloads.vision.data import (
    MANIFEST_MAX_BYTES,
    FormattedImages,
    ImageSpec,
    decode_images,
)
from ddpflow.workloads.vision.image_folder import (
    BadImage,
    DatasetError,
    ImageIndex,
    check_bad_share,
    check_classes_have_images,
    list_image_folder,
    pixel_limit,
)
from ddpflow.workloads.vision.split import stratified_split

if TYPE_CHECKING:
    import distributed

RunChunks = Callable[["ChunkTarget", Sequence["ImageChunk"]], list["ChunkResult"]]
FORMAT_VERSION = 1
STORE_FOLDER = ("data", "image-shards")
DEFAULT_SHARD_MB = 64.0
# Chunks are at least half and at most twice the target size: the content-defined cut
# points give sizes that vary around the target, and these bounds keep a shard's memory
# (one chunk decoded at a time on a worker) within a factor of two of what was asked.
MIN_CHUNK_FACTOR, MAX_CHUNK_FACTOR = 0.5, 2.0
CHUNK_RECORD_MAX_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ImageChunk:
    """One chunk: the files one worker decodes into one shard."""

    split: str  # "train" or "val"
    keys: tuple[str, ...]
    labels: tuple[int, ...]
    sizes: tuple[int, ...]  # as listed: how many reads go at once (objects.read_batches)
    key: str  # the content key: the chunk record's name


@dataclass(frozen=True)
class ChunkTarget:
    """What every chunk's worker needs besides its chunk (small: sent with each task)."""

    root: str
    store: str  # <artifact_root>/data/image-shards
    spec: ImageSpec
    max_image_bytes: int
    encoding: ShardEncoding = RAW  # how the shards hold the images


@dataclass(frozen=True)
class ShardPlan:
    """What plan_shards found: the chunks to format, and what index_shards needs."""

    target: ChunkTarget
    key: str  # this folder's format: its manifest is <store>/<key>.json
    classes: tuple[str, ...]
    fingerprint: str
    chunks: tuple[ImageChunk, ...]
    num_files: int
    skipped: tuple[BadImage, ...]
    ignored: tuple[str, ...]

    @property
    def formatted_mb(self) -> float:
        """The formatted size of the folder's images (before any fails to decode), MiB."""
        images = sum(len(c.keys) for c in self.chunks)
        return images * record_bytes(self.target.spec) / 2**20

    def manifest_uri(self) -> str:
        return storage.join(self.target.store, f"{self.key}.json")


@dataclass(frozen=True)
class ChunkResult:
    """A formatted chunk: its shard (None when no image of it decoded) and its bad files."""

    split: str
    shard: ShardInfo | None
    keys: tuple[str, ...]  # the decoded ones, in the shard's order
    bad: tuple[BadImage, ...]
    reused: bool = False


def record_bytes(spec: ImageSpec) -> int:
    return 3 * spec.image_size * spec.image_size


def plan_shards(
    root: str,
    artifact_root: str,
    spec: ImageSpec,
    val_fraction: float,
    seed: int,
    max_image_mb: float,
    shard_mb: float = DEFAULT_SHARD_MB,
    encoding: ShardEncoding = RAW,
) -> ShardPlan:
    """List and split `root` and cut it into chunks of about `shard_mb` formatted (decoded
    images: a jpeg shard of the chunk is smaller), written in `encoding`."""
    if not shard_mb > 0:
        raise ValueError(f"shard_mb={shard_mb:g} must be above 0 (MiB per shard); pass e.g. 64")
    index = list_image_folder(root, max_image_mb)
    keys = [k for k, _ in index.samples]
    labels = [label for _, label in index.samples]
    train, val = stratified_split(keys, labels, val_fraction, seed)
    if not val:
        raise DatasetError(
            f"{redact_url(root)} has no class with 2 or more images, so nothing can be held "
            "out for validation; add images"
        )
    target = max(1, int(shard_mb * 2**20 // record_bytes(spec)))
    settings = (
        f"v{FORMAT_VERSION}-{spec}-{index.max_image_bytes}-{len(index.classes)}"
        + encoding.cache_key()  # nothing for raw: its keys stay those of earlier formats
    )
    chunks = [
        chunk
        for name, rows in (("train", train), ("val", val))
        for chunk in _chunks(name, [index.samples[i] for i in rows], index, settings, target)
    ]
    folder_key = f"{index.fingerprint}-{settings}-{val_fraction:g}-{seed}-{target}"
    store = storage.join(artifact_root, *STORE_FOLDER)
    return ShardPlan(
        target=ChunkTarget(root, store, spec, index.max_image_bytes, encoding),
        key=storage.sha256_hex(folder_key.encode())[:16],
        classes=tuple(index.classes),
        fingerprint=index.fingerprint,
        chunks=tuple(chunks),
        num_files=len(index.samples) + len(index.skipped),
        skipped=tuple(index.skipped),
        ignored=tuple(index.ignored),
    )


def _chunks(
    split: str, samples: list[tuple[str, int]], index: ImageIndex, settings: str, target: int
) -> list[ImageChunk]:
    """Content-defined chunks of `samples`, ordered by a hash of each key."""
    ordered = sorted(samples, key=lambda s: _hash(s[0]))
    low, high = max(1, int(target * MIN_CHUNK_FACTOR)), max(1, int(target * MAX_CHUNK_FACTOR))
    # Past the minimum, a key ends its chunk with probability 1 / (target - low): chunks
    # then average the target, and a file added or removed moves only nearby cut points.
    odds = max(1, target - low)
    chunks: list[ImageChunk] = []
    members: list[tuple[str, int]] = []
    for sample in ordered:
        members.append(sample)
        cut = len(members) >= low and int.from_bytes(_hash("cut", sample[0])[:8]) % odds == 0
        if cut or len(members) >= high:
            chunks.append(_chunk(split, members, index, settings))
            members = []
    if members:
        chunks.append(_chunk(split, members, index, settings))
    return chunks


def _chunk(
    split: str, members: list[tuple[str, int]], index: ImageIndex, settings: str
) -> ImageChunk:
    content = hashlib.sha256(settings.encode())
    for key, label in members:
        version = index.versions.get(key)
        content.update(f"{key}\0{index.sizes.get(key)}\0{version}\0{label}\n".encode())
    keys = tuple(k for k, _ in members)
    sizes = tuple(index.sizes.get(k, 0) for k in keys)
    labels = tuple(label for _, label in members)
    return ImageChunk(split, keys, labels, sizes, content.hexdigest()[:32])


def _hash(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode()).digest()


def format_chunk(target: ChunkTarget, chunk: ImageChunk) -> ChunkResult:
    """Decode one chunk into one shard, or reuse the shard its record names."""
    record_uri = storage.join(target.store, "chunks", f"{chunk.key}.json")
    shards = storage.join(target.store, SHARDS_FOLDER)
    if storage.exists(record_uri):
        done = _read_record(record_uri)
        if done.shard is None or _shard_present(shards, done.shard):
            return ChunkResult(chunk.split, done.shard, done.keys, done.bad, reused=True)
    sizes = dict(zip(chunk.keys, chunk.sizes, strict=True))
    keys, images, bad = decode_images(
        target.root,
        chunk.keys,
        target.max_image_bytes,
        sizes,
        target.spec.transform(),
        pixel_limit(target.spec.image_size),
    )
    labels_by_key = dict(zip(chunk.keys, chunk.labels, strict=True))
    shard = None
    if images:
        records = np.stack([image.numpy() for image in images])
        shard = write_shard(shards, records, [labels_by_key[k] for k in keys], target.encoding)
    result = ChunkResult(chunk.split, shard, tuple(keys), tuple(bad))
    record = {
        "shard": None if shard is None else shard.to_dict(),
        "keys": keys,
        "bad": [asdict(b) for b in bad],
    }
    storage.write_bytes(record_uri, json.dumps(record).encode())  # after its shard
    return result


def _read_record(uri: str) -> ChunkResult:
    data = json.loads(storage.read_bytes(uri, CHUNK_RECORD_MAX_BYTES))
    shard = None if data["shard"] is None else ShardInfo.from_dict(data["shard"])
    bad = tuple(BadImage(**b) for b in data["bad"])
    return ChunkResult("", shard, tuple(data["keys"]), bad)


def _shard_present(folder: str, shard: ShardInfo) -> bool:
    fs, path = storage.url_to_fs(storage.join(folder, shard.name))
    try:
        return bool(fs.size(path) == shard.nbytes)
    except FileNotFoundError:
        return False


def reusable(plan: ShardPlan) -> FormattedImages | None:
    """The stored format of this plan when it and every shard it lists are there."""
    uri = plan.manifest_uri()
    if not storage.exists(uri):
        return None
    stored = FormattedImages(**json.loads(storage.read_bytes(uri, MANIFEST_MAX_BYTES)))
    if not shards_present(stored.train_uri, stored.val_uri):
        return None
    return FormattedImages(**{**asdict(stored), "reused": True})


def index_shards(
    plan: ShardPlan,
    results: Sequence[ChunkResult],
    max_bad_fraction: float,
) -> FormattedImages:
    """Check what decoding found, write both splits' indexes and the manifest (last)."""
    shown = redact_url(plan.target.root)
    bad = sorted([*plan.skipped, *(b for r in results for b in r.bad)], key=lambda b: b.key)
    check_bad_share(shown, plan.num_files, bad, max_bad_fraction)
    labels_by_key = {k: c.labels[i] for c in plan.chunks for i, k in enumerate(c.keys)}
    decoded = [labels_by_key[k] for r in results for k in r.keys]
    check_classes_have_images(shown, plan.classes, decoded, "no readable image")
    store, size = plan.target.store, plan.target.spec.image_size
    shape = (3, size, size)
    uris = {}
    counts = {}
    for split in ("train", "val"):
        shards = tuple(r.shard for r in results if r.split == split and r.shard is not None)
        if not shards:
            raise DatasetError(
                f"no image of the {split} split of {shown} could be read; fix the files or "
                "raise val_fraction"
            )
        uris[split] = storage.join(store, f"{plan.key}-{split}.shards.json")
        write_index(uris[split], shape, shards, encoding=plan.target.encoding)
        counts[split] = sum(s.count for s in shards)
    val_keys = [k for r in results if r.split == "val" and r.shard is not None for k in r.keys]
    result = FormattedImages(
        train_uri=uris["train"],
        val_uri=uris["val"],
        val_keys_uri=storage.join(store, f"{plan.key}-val_keys.json"),
        classes=list(plan.classes),
        num_train=counts["train"],
        num_val=counts["val"],
        image_size=size,
        fingerprint=plan.fingerprint,
        num_files=plan.num_files,
        bad=[asdict(b) for b in bad],
        ignored=list(plan.ignored),
    )
    storage.write_bytes(result.val_keys_uri, json.dumps(val_keys).encode())
    storage.write_bytes(plan.manifest_uri(), json.dumps(asdict(result)).encode())  # last
    return result


def format_shards(
    plan: ShardPlan,
    max_bad_fraction: float,
    run_chunks: RunChunks | None = None,
) -> FormattedImages:
    """The plan's format: reused when stored whole, else its chunks formatted by
    `run_chunks` (default: here, one after another; the flow maps them as tasks over the
    cluster; format_shards_on gives them to a Dask client) and indexed."""
    stored = reusable(plan)
    if stored is not None:
        return stored
    if run_chunks is None:
        results = [format_chunk(plan.target, chunk) for chunk in plan.chunks]
    else:
        results = run_chunks(plan.target, plan.chunks)
    return index_shards(plan, results, max_bad_fraction)


def format_shards_on(
    client: distributed.Client, plan: ShardPlan, max_bad_fraction: float
) -> FormattedImages:
    """format_shards with each chunk a Dask task on `client`'s workers."""

    def on_cluster(target: ChunkTarget, chunks: Sequence[ImageChunk]) -> list[ChunkResult]:
        futures = client.map(format_chunk, [target] * len(chunks), chunks, pure=False)
        return client.gather(futures)

    return format_shards(plan, max_bad_fraction, on_cluster)
