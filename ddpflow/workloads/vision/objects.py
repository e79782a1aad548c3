"""Listing and reading the objects of an image folder without trusting what they are.

A local folder entry can be anything: a FIFO named x.png blocks its reader forever, a
symlink to /dev/zero reads until memory runs out, a symlink out of the folder reads a file
the user never meant to share. Local entries are checked with lstat/realpath when listed
and again on the open descriptor when read (the folder may change in between), so no read
ever starts on something that is not a regular file inside the folder. Object stores have
none of these; their listing's size gives the cap.

Only a verdict on the object itself (not a regular file, outside the folder, too large,
not decodable) may be recorded as bad. Any other failed read is retried when transient and
otherwise fails the run: a network blip must never drop an image from a cached manifest.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from ddpflow import storage
from ddpflow.storage.bounded import call_bounded
from ddpflow.storage.capped_read import read_timeout_s
from ddpflow.storage.redact import redact_url
from ddpflow.storage.retry import is_transient, retry_call

DEFAULT_MAX_IMAGE_MB = 20.0
# The largest per-image cap a run may set (max_image_mb): far above any photo, and what one
# object may hold in memory at once on top of the decoded images.
MAX_IMAGE_MB = 256.0
# Object-store reads go in concurrent batches of at most this many bytes (the listed sizes,
# each at most the cap) and this many objects: memory in flight is bounded by bytes, not by
# a count of objects of any size. An object larger than the budget is read alone.
READ_BUDGET_BYTES = 256 * 2**20
MAX_READS_IN_FLIGHT = 256
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


class BadObject(Exception):
    """The entry itself is unusable as an image; `reason` says why, for the manifest."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ImageReadError(RuntimeError):
    """A read failed for a reason that says nothing about the image (network, access)."""


@dataclass(frozen=True)
class Listing:
    class_dirs: set[str]
    files: dict[str, dict[str, Any]]  # key -> {"size", "mtime" or "ETag", "problem"}
    linked_classes: list[str] = field(default_factory=list)  # symlinked class folders


def mb_to_bytes(max_mb: float) -> int:
    return int(max_mb * 2**20)


def too_large(size: int, max_bytes: int) -> str:
    return f"{size} bytes, over the per-image cap of {max_bytes / 2**20:g} MiB (max_image_mb)"


def is_local(root: str) -> bool:
    return isinstance(storage.url_to_fs(root)[0], LocalFileSystem)


def list_objects(root: str, max_bytes: int) -> Listing:
    """Every entry under `root`, each file with the problem that rules it out (or None)."""
    fs, base = storage.url_to_fs(root)
    if isinstance(fs, LocalFileSystem):
        return _list_local(base, max_bytes)
    base = base.rstrip("/")
    listing = Listing(set(), {})
    for name, info in fs.find(base, withdirs=True, detail=True).items():
        rel = name.rstrip("/")[len(base) :].lstrip("/")
        if not rel:
            continue
        if "/" not in rel:  # torchvision ignores files at the top level, and so do we
            if info.get("type") == "directory":
                listing.class_dirs.add(rel)
            continue
        listing.class_dirs.add(rel.split("/", 1)[0])
        if info.get("type") == "directory":
            continue
        size = int(info.get("size") or 0)
        problem = "not a regular file" if info.get("type") != "file" else None
        problem = problem or (too_large(size, max_bytes) if size > max_bytes else None)
        listing.files[rel] = {**info, "problem": problem}
    return listing


def _list_local(base: str, max_bytes: int) -> Listing:
    real_base = os.path.realpath(base)
    listing = Listing(set(), {})
    # followlinks=False: a symlinked folder could lead outside the root or into a loop.
    for dirpath, dirnames, filenames in os.walk(real_base):
        rel_dir = os.path.relpath(dirpath, real_base)
        for name in [*dirnames, *filenames]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            path = os.path.join(dirpath, name)
            is_link = os.path.islink(path)
            if name in dirnames and not is_link:
                if "/" not in rel:
                    listing.class_dirs.add(rel)
                continue
            if "/" not in rel:
                if is_link and name in dirnames:  # a whole class would vanish unseen
                    listing.linked_classes.append(rel)
                continue  # top-level files are not samples (torchvision's rule)
            listing.class_dirs.add(rel.split("/", 1)[0])
            listing.files[rel] = _local_info(path, real_base, max_bytes)
    return listing


def _local_info(path: str, real_base: str, max_bytes: int) -> dict[str, Any]:
    try:
        st = _target_stat(path, real_base)
    except BadObject as bad:
        return {"size": 0, "mtime": 0, "problem": bad.reason}
    problem = None if stat.S_ISREG(st.st_mode) else _not_regular(st.st_mode)
    if problem is None and st.st_size > max_bytes:
        problem = too_large(st.st_size, max_bytes)
    return {"size": st.st_size, "mtime": st.st_mtime, "problem": problem}


def _target_stat(path: str, real_base: str) -> os.stat_result:
    """stat of what `path` names, refusing links that leave the folder or lead nowhere."""
    st = os.lstat(path)
    if not stat.S_ISLNK(st.st_mode):
        return st
    target = os.path.realpath(path)
    if os.path.commonpath([target, real_base]) != real_base:
        raise BadObject("a symlink that leads outside the image folder")
    try:
        return os.stat(target)
    except FileNotFoundError:
        raise BadObject("a symlink to nothing (broken link)") from None


def _not_regular(mode: int) -> str:
    kind = "a symlinked folder" if stat.S_ISDIR(mode) else _KINDS.get(stat.S_IFMT(mode), "")
    return f"not a regular file ({kind or 'special file'})"


def read_local(path: str, real_base: str, max_bytes: int) -> bytes:
    """One regular file inside the folder, at most `max_bytes`; BadObject for anything else."""
    _target_stat(path, real_base)
    # O_NONBLOCK: a FIFO swapped in since the listing opens at once instead of waiting
    # for a writer, and is then refused by the fstat below. O_NOFOLLOW: the resolved path
    # must not have become a link meanwhile.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.realpath(path), flags)
    except OSError as error:
        raise BadObject(f"cannot be opened as a regular file ({error.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadObject(_not_regular(st.st_mode))
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise BadObject(too_large(max(st.st_size, len(data)), max_bytes))
    return data


def read_objects(
    root: str, keys: Sequence[str], max_bytes: int, sizes: Mapping[str, int] | None = None
) -> Iterator[tuple[str, bytes | BadObject]]:
    """(key, bytes) per key, or (key, BadObject) where the object itself is unusable.

    `sizes`: the listed size of each key (unknown ones count as `max_bytes`), which sets
    how many object-store reads go at once (read_batches). Raises ImageReadError when a
    read fails for another reason: retried first when the error is transient (connection
    reset, 5xx, timeout), at once when it is not.
    """
    fs, base = storage.url_to_fs(root)
    base = base.rstrip("/")
    if isinstance(fs, LocalFileSystem):
        real_base = os.path.realpath(base)
        for key in keys:
            yield key, _local_or_bad(f"{base}/{key}", real_base, max_bytes)
        return
    sizes = sizes or {}
    for batch in read_batches(keys, sizes, max_bytes):
        empty = [key for key in batch if sizes.get(key) == 0]
        for key in empty:  # a ranged read of an empty object is an error on S3
            yield key, BadObject("an empty file (0 bytes)")
        paths = {f"{base}/{key}": key for key in batch if key not in empty}
        # At most the listed size (at most the cap) + 1 bytes of each: the batch's bytes in
        # flight are what it was planned for, even when every object has grown since the
        # listing. One that did is read again alone, up to the cap + 1, and refused over it.
        ends = [_cost(sizes, key, max_bytes) for key in paths.values()]
        limits = {}
        if isinstance(fs, AsyncFileSystem):  # a deadline for the batch, as for a single read
            limits["timeout"] = read_timeout_s(sum(ends))
        contents = fs.cat_ranges(list(paths), [0] * len(ends), ends, on_error="return", **limits)
        for (path, key), data, end in zip(paths.items(), contents, ends, strict=True):
            uri = storage.join(root, key)
            if not isinstance(data, bytes):
                data = _retry_remote(fs, path, uri, data, max_bytes)
            elif len(data) >= end and end <= max_bytes:  # grown since the listing
                data = _retry_remote(fs, path, uri, None, max_bytes, grown=True)
            fits = len(data) <= max_bytes
            yield key, data if fits else BadObject(too_large(len(data), max_bytes))


def read_batches(
    keys: Sequence[str], sizes: Mapping[str, int], max_bytes: int
) -> Iterator[list[str]]:
    """`keys` in order, in batches of at most READ_BUDGET_BYTES and MAX_READS_IN_FLIGHT."""
    batch: list[str] = []
    total = 0
    for key in keys:
        cost = _cost(sizes, key, max_bytes)
        if batch and (total + cost > READ_BUDGET_BYTES or len(batch) >= MAX_READS_IN_FLIGHT):
            yield batch
            batch, total = [], 0
        batch.append(key)
        total += cost
    if batch:
        yield batch


def _cost(sizes: Mapping[str, int], key: str, max_bytes: int) -> int:
    return min(sizes.get(key, max_bytes), max_bytes) + 1


def _local_or_bad(path: str, real_base: str, max_bytes: int) -> bytes | BadObject:
    try:
        # A deadline as for any other read: a hung network mount must not hang the format.
        return call_bounded(
            lambda: read_local(path, real_base, max_bytes),
            read_timeout_s(max_bytes),
            f"reading {path}",
        )
    except BadObject as bad:
        return bad
    except TimeoutError as error:
        raise ImageReadError(
            f"{error}; it is not recorded as a bad image. Check the filesystem the folder is "
            "on (a hung network mount?) and rerun"
        ) from error
    except OSError as error:
        raise ImageReadError(
            f"cannot read {path} ({error}); fix its permissions or remove it, then rerun"
        ) from error


def _retry_remote(
    fs: Any, path: str, uri: str, error: Any, max_bytes: int, grown: bool = False
) -> bytes:
    """The object read alone, up to the cap + 1: after a transient error, or (`grown`)
    because it holds more than the listing said."""
    shown = redact_url(uri)
    if grown or (isinstance(error, BaseException) and is_transient(error)):
        try:
            return retry_call(
                lambda: fs.cat_file(path, start=0, end=max_bytes + 1), what=f"read {shown}"
            )
        except Exception as final:  # noqa: BLE001 - reported below with the key
            error = final
    raise ImageReadError(
        f"cannot read {shown} ({type(error).__name__}: {error}); it is not recorded as a bad "
        "image. Check the store (reachable, credentials, permissions) and rerun"
    ) from error if isinstance(error, BaseException) else None
