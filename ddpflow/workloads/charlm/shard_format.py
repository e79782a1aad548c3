"""Format a large name corpus into shards on the cluster, for ranks that stream it.

The in-memory path (ddpflow.workloads.charlm.data.format_corpus) formats every window in one
process and every rank loads them all: 9 bytes a window, about 70 bytes a name, so a corpus
at the 100 MiB source cap is some 700 MiB in every rank. Here:

1. `plan_corpus_shards` (one process) parses and splits the names as the in-memory path
   does and cuts each split into chunks of consecutive names of about `shard_mb`
   formatted; it writes nothing (`auto` may still choose the in-memory path).
   `write_train_names` then keeps the training names for the novelty check.
2. `format_name_chunk` (one per chunk, anywhere on the cluster) formats one chunk's windows
   and writes them as one shard of records alone (the targets are in the window:
   ddpflow.shards.shard_file), named by its content, so a rerun writes nothing new.
3. `index_corpus_shards` (one process) writes both splits' indexes and the manifest, last.

Everything is under `<artifact_root>/data/corpus-shards/`: `shards/`, and per formatted
corpus `<key>.json` (the manifest), `<key>-train.shards.json`, `<key>-val.shards.json` and
`<key>-train_names.json`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from ddpflow import storage
from ddpflow.shards.index import SHARDS_FOLDER, shards_present, write_index
from ddpflow.shards.shard_file import ShardInfo, write_shard
from ddpflow.workloads.charlm.corpus import MAX_SOURCE_BYTES, parse_names, split_holdout
from ddpflow.workloads.charlm.data import MANIFEST_MAX_BYTES, FormattedCorpus

FORMAT_VERSION = 1
STORE_FOLDER = ("data", "corpus-shards")
WINDOW_BYTES = 9  # formatting.WINDOW_LEN, written out: this module stays free of torch


@dataclass(frozen=True)
class NameChunk:
    """Consecutive names of one split: one worker formats them into one shard."""

    split: str  # "train" or "val"
    names: tuple[str, ...]


@dataclass(frozen=True)
class CorpusShardPlan:
    """What plan_corpus_shards found; `chunks` is emptied before it goes to the index task."""

    store: str
    key: str
    data_hash: str
    train_names_uri: str
    num_train_names: int
    num_val_names: int
    num_windows: int
    clean_report: dict
    chunks: tuple[NameChunk, ...]

    @property
    def formatted_mb(self) -> float:
        return self.num_windows * WINDOW_BYTES / 2**20

    def manifest_uri(self) -> str:
        return storage.join(self.store, f"{self.key}.json")

    def train_names(self) -> list[str]:
        return [name for chunk in self.chunks if chunk.split == "train" for name in chunk.names]

    def without_chunks(self) -> CorpusShardPlan:
        return replace(self, chunks=())


@dataclass(frozen=True)
class NameShard:
    split: str
    shard: ShardInfo


def plan_corpus_shards(
    raw_uri: str, artifact_root: str, holdout_fraction: float, shard_mb: float
) -> CorpusShardPlan:
    """Parse, split and chunk the corpus copy at `raw_uri` (fetch_corpus checked it)."""
    if not shard_mb > 0:
        raise ValueError(f"shard_mb={shard_mb:g} must be above 0 (MiB per shard); pass e.g. 64")
    data = storage.read_bytes(raw_uri, MAX_SOURCE_BYTES)
    digest = storage.sha256_hex(data)
    names, report = parse_names(data, raw_uri)
    train, val = split_holdout(names, holdout_fraction)
    target = max(1, int(shard_mb * 2**20 // WINDOW_BYTES))  # windows a shard
    key = f"{digest[:16]}-v{FORMAT_VERSION}-h{holdout_fraction:g}-w{target}"
    store = storage.join(artifact_root, *STORE_FOLDER)
    key = storage.sha256_hex(key.encode())[:16]
    # Written by write_train_names once the flow chose shards: `auto` may still format in
    # memory, and a plan must leave nothing behind then.
    train_names_uri = storage.join(store, f"{key}-train_names.json")
    chunks = [*_chunks("train", train, target), *_chunks("val", val, target)]
    return CorpusShardPlan(
        store=store,
        key=key,
        data_hash=digest,
        train_names_uri=train_names_uri,
        num_train_names=len(train),
        num_val_names=len(val),
        num_windows=sum(len(name) + 1 for name in names),
        clean_report=report.as_dict(),
        chunks=tuple(chunks),
    )


def write_train_names(uri: str, names: Sequence[str]) -> None:
    """The distinct training names (the evaluation's novelty check reads them)."""
    storage.write_bytes(uri, json.dumps(sorted(set(names))).encode())


def _chunks(split: str, names: Sequence[str], target: int) -> list[NameChunk]:
    """Consecutive names, about `target` windows each (a name gives len + 1)."""
    chunks, members, windows = [], [], 0
    for name in names:
        members.append(name)
        windows += len(name) + 1
        if windows >= target:
            chunks.append(NameChunk(split, tuple(members)))
            members, windows = [], 0
    if members:
        chunks.append(NameChunk(split, tuple(members)))
    return chunks


def format_name_chunk(store: str, chunk: NameChunk) -> NameShard:
    """One chunk's windows as one shard of records alone."""
    from ddpflow.workloads.charlm.formatting import format_names  # needs torch

    windows = format_names(list(chunk.names)).numpy()
    return NameShard(chunk.split, write_shard(storage.join(store, SHARDS_FOLDER), windows))


def reusable_corpus(plan: CorpusShardPlan) -> FormattedCorpus | None:
    """The stored format of this plan when it and every shard it lists are there."""
    if not storage.exists(plan.manifest_uri()):
        return None
    stored = json.loads(storage.read_bytes(plan.manifest_uri(), MANIFEST_MAX_BYTES))
    if not shards_present(stored["train_uri"], stored["val_uri"]):
        return None
    return FormattedCorpus(**{**stored, "reused": True})


def index_corpus_shards(plan: CorpusShardPlan, results: Sequence[NameShard]) -> FormattedCorpus:
    """Both splits' indexes, then the manifest (last: its presence means all is there)."""
    uris, counts = {}, {}
    for split in ("train", "val"):
        shards = tuple(r.shard for r in results if r.split == split)
        uris[split] = storage.join(plan.store, f"{plan.key}-{split}.shards.json")
        write_index(uris[split], (WINDOW_BYTES,), shards, labeled=False)
        counts[split] = sum(s.count for s in shards)
    result = FormattedCorpus(
        train_uri=uris["train"],
        val_uri=uris["val"],
        train_names_uri=plan.train_names_uri,
        data_hash=plan.data_hash,
        num_train_names=plan.num_train_names,
        num_val_names=plan.num_val_names,
        num_train_samples=counts["train"],
        num_val_samples=counts["val"],
        clean_report=plan.clean_report,
    )
    storage.write_bytes(plan.manifest_uri(), json.dumps(asdict(result)).encode())
    return result
