"""Reading one whole file or object that ddpflow did not make itself, with three bounds.

A URI that reaches a read (weights=, a checkpoint named by a registry tag, `latest.json`, a
corpus source) can name anything: a FIFO blocks its reader until a writer comes, which may
be never; /dev/zero or a growing file reads until memory runs out; a directory fails
somewhere deep in a client library. So a read here is bounded three ways:

- kind: a local path must be a regular file, checked with stat before it is opened and
  again with fstat on the descriptor (opened with O_NONBLOCK, so a FIFO swapped in between
  opens at once instead of waiting for a writer); an object store entry must be a file;
- size: the size is checked against the caller's cap before anything is read, and at most
  cap + 1 bytes are ever read, so a file that grows meanwhile is refused too;
- time: the whole read runs within a deadline of READ_TIMEOUT_BASE_S plus the size at
  READ_BYTES_PER_S, on a thread the caller stops waiting for (ddpflow.storage.bounded).
"""

from __future__ import annotations

import os
import stat
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ddpflow.storage.bounded import call_bounded
from ddpflow.storage.redact import redact_url

# The listing (stat or HEAD) of one file; and what a read may take: a slow 5 MB/s on top.
READ_TIMEOUT_BASE_S = 60.0
READ_BYTES_PER_S = 5e6
_CHUNK = 2**20
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class ReadRefused(ValueError):
    """The input is not something ddpflow reads whole: not a regular file, or over its cap.

    The message names the input (redacted) and the fix.
    """


class TooLarge(ReadRefused):
    """Over the cap: `size` bytes or more (all that is known of a stream), `max_bytes` allowed."""

    def __init__(self, message: str, size: int, max_bytes: int) -> None:
        super().__init__(message)
        self.size = size
        self.max_bytes = max_bytes


def read_timeout_s(num_bytes: int) -> float:
    return READ_TIMEOUT_BASE_S + num_bytes / READ_BYTES_PER_S


def read_capped(
    fs: Any, path: str, shown: str, max_bytes: int, fix: str, cap_setting: str = ""
) -> bytes:
    """The whole file `path` of `fs`, at most `max_bytes`, within read_timeout_s().

    `shown` names the input in errors (it is redacted again here); `fix` ends every
    ReadRefused message (what to pass instead), and `cap_setting`, where one raises the
    cap, ends TooLarge's. TimeoutError names the input when the listing or the read
    outlasts its deadline.
    """
    shown = redact_url(shown)
    size_fix = f"{fix}, or raise {cap_setting}" if cap_setting else fix
    if isinstance(fs, LocalFileSystem):
        # stat never blocks on a FIFO, but a hung network mount blocks it too.
        st = call_bounded(lambda: os.stat(path), READ_TIMEOUT_BASE_S, f"listing {shown}")
        _check_kind(shown, st.st_mode, fix)
        _check_size(shown, st.st_size, max_bytes, size_fix)
        return call_bounded(
            lambda: _read_local(path, shown, max_bytes, fix, size_fix),
            read_timeout_s(min(st.st_size, max_bytes)),
            f"reading {shown}",
        )
    info = call_bounded(lambda: fs.info(path), READ_TIMEOUT_BASE_S, f"listing {shown}")
    if info.get("type") != "file":
        raise ReadRefused(f"{shown} is not a file (it is a {info.get('type')}); {fix}")
    size = info.get("size")
    if size is not None:
        _check_size(shown, int(size), max_bytes, size_fix)
    expected = max_bytes if size is None else min(int(size), max_bytes)
    data = call_bounded(
        lambda: _read_stream(fs, path, max_bytes + 1), read_timeout_s(expected), f"reading {shown}"
    )
    _check_size(shown, len(data), max_bytes, size_fix)  # grew since it was listed
    return data


def _read_local(path: str, shown: str, max_bytes: int, fix: str, size_fix: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(fd)  # what was opened, whatever the path names now
        _check_kind(shown, st.st_mode, fix)
        _check_size(shown, st.st_size, max_bytes, size_fix)
        # One more byte than the size: a file that grew since fstat is seen to be larger.
        data = file.read(min(st.st_size, max_bytes) + 1)
        if len(data) > st.st_size:
            data += file.read(max(0, max_bytes + 1 - len(data)))
    _check_size(shown, len(data), max_bytes, size_fix)
    return data


def _read_stream(fs: Any, path: str, limit: int) -> bytes:
    chunks, total = [], 0
    with fs.open(path, "rb") as stream:
        while total < limit:
            chunk = stream.read(min(_CHUNK, limit - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    return b"".join(chunks)


def _check_kind(shown: str, mode: int, fix: str) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
        raise ReadRefused(f"{shown} is not a regular file (it is {kind}); {fix}")


def _check_size(shown: str, size: int, max_bytes: int, fix: str) -> None:
    if size > max_bytes:
        raise TooLarge(
            f"{shown} is larger than the {max_bytes / 2**20:g} MiB ({max_bytes} bytes) cap "
            f"on this input ({size} bytes or more); {fix}",
            size,
            max_bytes,
        )
