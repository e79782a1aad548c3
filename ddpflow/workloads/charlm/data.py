"""Download and format the name corpus into the artifact store, keyed by content hash.

Both steps are idempotent: a rerun on the same bytes finds its outputs and skips the work.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from fsspec.implementations.http import HTTPFileSystem

from ddpflow import storage
from ddpflow.shards.index import is_index_uri, read_index
from ddpflow.shards.settings import StreamSettings
from ddpflow.storage.bounded import call_bounded
from ddpflow.storage.capped_read import ReadRefused, TooLarge, read_capped, read_timeout_s
from ddpflow.storage.redact import clean_cause, redact_text, redact_url
from ddpflow.storage.retry import retry_call
from ddpflow.workloads.charlm.corpus import (
    MAX_SOURCE_BYTES,
    CorpusError,
    parse_names,
    source_too_large,
    split_holdout,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from ddpflow.training.samples import Samples

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 2**20  # counts and URIs


@dataclass(frozen=True)
class SourceCopy:
    uri: str
    sha256: str
    num_bytes: int
    reused: bool


@dataclass(frozen=True)
class FormattedCorpus:
    """URIs of the formatted tensors plus what cleaning and splitting did."""

    train_uri: str
    val_uri: str
    train_names_uri: str
    data_hash: str
    num_train_names: int
    num_val_names: int
    num_train_samples: int
    num_val_samples: int
    clean_report: dict[str, Any]
    reused: bool = False


NETRC_FIX = "put the credentials in ~/.netrc (or the file $NETRC names), never in the source URL"


def source_storage_options(source: str) -> dict[str, Any]:
    """fsspec options for reading the source.

    Public buckets (like the pet-name tutorial's) are read anonymously when no AWS key is
    configured.
    HTTP sources trust the environment: a netrc entry supplies basic-auth credentials
    (and *_PROXY variables a proxy), so no credential has to sit in the source URL.
    """
    if source.startswith("s3://") and not os.environ.get("AWS_ACCESS_KEY_ID"):
        return {"anon": True}
    if source.startswith(("http://", "https://")):
        return {"client_kwargs": {"trust_env": True}}
    return {}


def read_source(source: str, max_bytes: int = MAX_SOURCE_BYTES) -> bytes:
    """Bytes of any fsspec URL, at most `max_bytes`, retrying transient network errors.

    Every error names the source with its credentials hidden, and drops a cause whose
    text repeats them: the message ends up in Prefect states, logs and the terminal.
    """
    import fsspec

    shown = redact_url(source)

    def fetch() -> bytes:
        fs, path = fsspec.core.url_to_fs(source, **source_storage_options(source))
        return _read_capped(fs, path, shown, max_bytes)

    try:
        return retry_call(fetch, what=f"download {shown}")
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"source {shown!r} does not exist ({redact_text(str(error))}); pass source= a "
            "local path, https:// URL or s3:// URL of a JSON list of names"
        ) from clean_cause(error)
    except Exception as error:  # noqa: BLE001 - re-raised, redacted where it must be
        cause, status = clean_cause(error), getattr(error, "status", None)
        if cause is error and status not in (401, 403):
            raise  # its text is clean, and its type is what callers know
        detail = f"{type(error).__name__}: {redact_text(str(error))}"
        fix = NETRC_FIX if status in (401, 403) else "check the URL and that it is reachable"
        raise OSError(f"source {shown!r} could not be read ({detail}); {fix}") from cause


def _read_capped(fs: Any, path: str, shown: str, max_bytes: int) -> bytes:
    """Refuse what is too large or not a regular file, and a read that takes too long."""
    if isinstance(fs, HTTPFileSystem):
        # A stream read in bounded pieces: the size may be unknown until the end. size=
        # skips open()'s size probe, whose failure (a 503 too) fsspec reports as
        # FileNotFoundError, which would hide a transient error from the retry.
        def stream() -> bytes:
            with fs.open(path, "rb", block_size=0, size=max_bytes + 1) as file:
                return _read_at_most(file, max_bytes + 1)

        data = call_bounded(stream, read_timeout_s(max_bytes), f"downloading {shown}")
    else:
        try:
            data = read_capped(fs, path, shown, max_bytes, "pass a JSON file of names")
        except TooLarge as large:
            raise source_too_large(shown, large.size, max_bytes) from None
        except ReadRefused as refused:
            raise CorpusError(str(refused)) from None
    if len(data) > max_bytes:  # a stream
        raise source_too_large(shown, len(data), max_bytes)
    return data


def _read_at_most(stream: Any, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = stream.read(min(2**20, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def fetch_corpus(source: str, artifact_root: str) -> SourceCopy:
    """Validate the source, then copy it under its content hash (skipped when present)."""
    data = read_source(source)
    parse_names(data, source)  # bad input fails here, before anything is written
    digest = storage.sha256_hex(data)
    uri = storage.join(artifact_root, "data", "raw", f"{digest[:16]}.json")
    reused = storage.exists(uri)
    if not reused:
        storage.write_bytes(uri, data)
    return SourceCopy(uri=uri, sha256=digest, num_bytes=len(data), reused=reused)


def format_corpus(raw_uri: str, artifact_root: str, holdout_fraction: float) -> FormattedCorpus:
    """Clean, split by name into train/holdout and format both as uint8 windows."""
    # Imported here: formatting needs torch, and the flow process imports this module for
    # its result types and starts without torch.
    from ddpflow.workloads.charlm.formatting import format_names

    data = storage.read_bytes(raw_uri, MAX_SOURCE_BYTES)  # the copy fetch_corpus checked
    digest = storage.sha256_hex(data)
    key = f"{digest[:16]}-v{FORMAT_VERSION}-h{holdout_fraction:g}"
    folder = storage.join(artifact_root, "data", "formatted", key)
    manifest_uri = storage.join(folder, MANIFEST)
    if storage.exists(manifest_uri):
        return FormattedCorpus(
            **{**json.loads(storage.read_bytes(manifest_uri, MANIFEST_MAX_BYTES)), "reused": True}
        )
    names, report = parse_names(data, raw_uri)
    train_names, val_names = split_holdout(names, holdout_fraction)
    train, val = format_names(train_names), format_names(val_names)
    result = FormattedCorpus(
        train_uri=storage.join(folder, "train.pt"),
        val_uri=storage.join(folder, "val.pt"),
        train_names_uri=storage.join(folder, "train_names.json"),
        data_hash=digest,
        num_train_names=len(train_names),
        num_val_names=len(val_names),
        num_train_samples=len(train),
        num_val_samples=len(val),
        clean_report=report.as_dict(),
    )
    storage.save_torch(result.train_uri, {"windows": train})
    storage.save_torch(result.val_uri, {"windows": val})
    storage.write_bytes(result.train_names_uri, json.dumps(sorted(set(train_names))).encode())
    # The manifest goes last: its presence means every file above is complete.
    storage.write_bytes(manifest_uri, json.dumps(asdict(result)).encode())
    return result


def load_windows(uri: str) -> torch.Tensor:
    return storage.load_torch(uri)["windows"]


def open_windows(
    uri: str, stream: StreamSettings | None = None, on_wait: Callable[[], None] | None = None
) -> Samples:
    """A formatted split as (x, y) samples: held in memory (a `.pt` file, format_corpus) or
    streamed from its shards (a `.shards.json` index, charlm.shard_format) as `stream`
    says, calling `on_wait` while a batch waits for its shard (ddpflow.shards.stream)."""
    from ddpflow.training.samples import TensorSamples
    from ddpflow.workloads.charlm.formatting import split_xy

    if not is_index_uri(uri):
        return TensorSamples(load_windows(uri), split_xy)
    from ddpflow.shards.stream import ShardStream

    stream = stream or StreamSettings()
    return ShardStream(
        read_index(uri),
        stream.window,
        stream.prefetch,
        on_wait,
        stream.read_bound_s,
        to_batch=split_xy,
        requests_in_flight=stream.requests_in_flight,
        max_bytes_in_flight=stream.max_bytes_in_flight,
        chunk_bytes=stream.chunk_bytes,
    )
