"""The artifact store: the only module that knows about fsspec (local folders, s3:// via s3fs).

Everything is addressed by URI strings so the same code works for a local folder and S3.
S3 settings come from the standard AWS variables (AWS_ENDPOINT_URL_S3 included), which s3fs
and botocore read themselves: nothing project-specific, and no secret passes through here.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from ddpflow.config import MAX_LOAD_ENV, max_load_bytes
from ddpflow.storage.capped_read import read_capped


def join(base: str, *parts: str) -> str:
    """Join URI parts with '/', whatever the scheme."""
    cleaned = [p.strip("/") for p in parts if p and p.strip("/")]
    return "/".join([base.rstrip("/"), *cleaned])


# Bounded S3 calls: a dead endpoint must fail in seconds, not stall every rank for minutes.
S3_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}}
# An upload to a server that accepted the connection but stopped answering (a paused or
# overloaded process) waits for its "100 Continue" with no timeout of botocore's at all:
# each write gets a deadline of its own, enough for the data at a slow 5 MB/s.
WRITE_TIMEOUT_BASE_S = 30.0
WRITE_TIMEOUT_BYTES_PER_S = 5e6


def s3_options() -> dict[str, Any]:
    """s3fs options from the standard AWS variables.

    botocore reads the keys and AWS_ENDPOINT_URL_S3 itself; the endpoint is passed as well
    because fsspec caches filesystem instances by their options, and a process that talks to
    two endpoints (tests do) must not get the first one's client for the second.
    """
    options: dict[str, Any] = {"config_kwargs": S3_CONFIG}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    return options


def url_to_fs(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and in-filesystem path for a URI (plain paths are local)."""
    if uri.startswith(("s3://", "s3a://")):
        return fsspec.core.url_to_fs(uri, **s3_options())
    return fsspec.core.url_to_fs(uri)


def exists(uri: str) -> bool:
    fs, path = url_to_fs(uri)
    return bool(fs.exists(path))


def read_bytes(
    uri: str, max_bytes: int, fix: str = "pass the URI of a regular file", cap_setting: str = ""
) -> bytes:
    """The whole file at `uri`, bounded in kind, size and time (ddpflow.storage.capped_read).

    Every caller states its cap: there is no read of "whatever size the file has".
    ReadRefused (a ValueError) names the URI and ends with `fix` (and, over the cap, with
    `cap_setting`, the setting that raises it, if there is one).
    """
    fs, path = url_to_fs(uri)
    return read_capped(fs, path, uri, max_bytes, fix, cap_setting)


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole object so that readers never see a partial one.

    Local files go to a temporary name first and are renamed into place (rename is atomic
    on POSIX). Object stores publish an object only when its single PUT (or multipart
    upload) completes, so a direct write already has that property. An object-store write
    that takes longer than write_timeout_s() raises FSTimeoutError (a TimeoutError).
    """
    fs, path = url_to_fs(uri)
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    if isinstance(fs, AsyncFileSystem):
        fs.pipe_file(path, data, timeout=write_timeout_s(len(data)))
    else:
        fs.pipe_file(path, data)


def write_timeout_s(num_bytes: int) -> float:
    return WRITE_TIMEOUT_BASE_S + num_bytes / WRITE_TIMEOUT_BYTES_PER_S


def delete(uri: str) -> None:
    fs, path = url_to_fs(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def list_names(uri: str) -> list[str]:
    """Base names of the entries directly under a folder URI ([] when it does not exist)."""
    fs, path = url_to_fs(uri)
    if not fs.exists(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def folder_usage(uri: str, suffix: str = "") -> tuple[int, int]:
    """(files, bytes) directly under a folder URI whose names end with `suffix` ((0, 0)
    when it does not exist): what a run keeps there, for its summary."""
    fs, path = url_to_fs(uri)
    if not fs.exists(path):
        return 0, 0
    sizes = [
        int(entry.get("size") or 0)
        for entry in fs.ls(path, detail=True)
        if entry.get("type") == "file" and entry["name"].endswith(suffix)
    ]
    return len(sizes), sum(sizes)


def save_torch(uri: str, obj: Any) -> int:
    """torch.save to a URI atomically; returns the number of bytes written."""
    import torch  # here, not at the top: the flow process imports storage and needs no torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    write_bytes(uri, data)
    return len(data)


def load_torch(uri: str, fix: str = "pass the URI of a file written by torch.save") -> Any:
    """torch.load with weights_only=True: plain tensors and containers, never pickled code.

    The file is read whole first, at most DDPFLOW_MAX_LOAD_MB (ddpflow.config.max_load_bytes).
    """
    import torch

    cap = max_load_bytes()
    data = read_bytes(uri, cap, fix, f"{MAX_LOAD_ENV} (now {cap / 2**20:g})")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
