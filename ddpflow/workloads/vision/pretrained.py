"""torchvision's ImageNet weights, loaded without trusting the download or the hub cache.

torchvision's own `Weights.get_state_dict()` goes through `torch.hub.load_state_dict_from_url`,
which unpickles with `weights_only=False` (any code in the file runs), checks the hash only
of a file it downloads (a file already in the hub cache is loaded as it is), and downloads
with no timeout and no size limit. So ddpflow does those steps itself, with torch.hub's
cache folder and file names, so a file torchvision cached is found and one cached here is
found by torchvision:

- a download goes to a temporary name in the cache folder, within a deadline and at most
  the size torchvision lists for the file, and is renamed into place only when its hash
  matches;
- every load, of a cached file too, reads the file whole (a regular file, capped, in time:
  ddpflow.storage.capped_read), hashes those very bytes against the hash in the file's name
  (the first 8 hex digits of its SHA-256, which is all torchvision publishes), and
  unpickles those bytes with `weights_only=True`: tensors and plain containers only.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import time
import urllib.request
import uuid
from urllib.parse import urlparse

import torch
import torchvision

from ddpflow import storage
from ddpflow.storage.capped_read import ReadRefused
from ddpflow.storage.redact import redact_url

# A download may take the base plus the file at a slow 1 MB/s (ResNet-50: about 160 s);
# each socket read waits SOCKET_TIMEOUT_S at most, so a stalled server fails in time too.
DOWNLOAD_BASE_S = 60.0
DOWNLOAD_BYTES_PER_S = 1e6
SOCKET_TIMEOUT_S = 30.0
_CHUNK = 2**20


class WeightsError(ValueError):
    """Pretrained weights could not be fetched or do not fit the architecture."""


def fetch_imagenet_state(arch: str) -> dict[str, torch.Tensor]:
    """torchvision's DEFAULT ImageNet weights for `arch`, from the hub cache or downloaded."""
    enum = torchvision.models.get_model_weights(arch).DEFAULT
    # torchvision lists each file's size in MiB; 1 MiB over it leaves room for its rounding.
    max_bytes = int((float(enum.meta["_file_size"]) + 1) * 2**20)
    try:
        return load_hub_weights(enum.url, max_bytes)
    except OSError as error:  # URLError is an OSError, so is a timeout
        raise WeightsError(
            f"could not fetch the ImageNet weights for {arch} ({enum}) from {enum.url}: "
            f"{error}. Without network access, pass weights=<URI> of a state_dict stored in "
            f"the artifact store (torch.save(torchvision.models.{arch}(weights='DEFAULT')"
            ".state_dict(), ...) on a machine that can download it), or weights=none to "
            "train from scratch"
        ) from error


def hub_cache_path(url: str) -> str:
    """Where torch.hub keeps the file of `url`: <TORCH_HOME>/hub/checkpoints/<file name>."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(url).path))


def load_hub_weights(url: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """The state_dict at `url` (a torch.hub-style name `<name>-<sha256 prefix>.<ext>`).

    Downloaded into the hub cache unless a file of that name is there; either way the
    bytes are hash-checked, then loaded with weights_only=True. WeightsError names the
    file and the fix for a hash mismatch, a file that is not a state_dict, or one that
    holds anything but tensors and plain containers.
    """
    expected = _hash_prefix(url)
    cached = hub_cache_path(url)
    if not os.path.lexists(cached):
        download(url, cached, expected, max_bytes)
    fix = f"delete {cached} to download it again"
    try:
        data = storage.read_bytes(cached, max_bytes, fix)
    except ReadRefused as refused:
        raise WeightsError(f"cached weights: {refused}") from None
    digest = hashlib.sha256(data).hexdigest()
    if not digest.startswith(expected):
        raise WeightsError(
            f"cached weights {cached} have SHA-256 {digest[:16]}..., not {expected}... as "
            f"their name says: the file is damaged or was replaced, and is not loaded; {fix}"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as error:
        raise WeightsError(
            f"{cached} is not a plain state_dict, refused by torch.load(weights_only=True) "
            f"({type(error).__name__}: {str(error)[:300]}); {fix}"
        ) from None
    if not isinstance(state, dict):
        raise WeightsError(f"{cached} holds a {type(state).__name__}, not a state_dict; {fix}")
    return state


def download(url: str, target: str, expected: str, max_bytes: int) -> None:
    """`url` to `target`, bounded in size and time; renamed into place only if its hash fits."""
    deadline = time.monotonic() + DOWNLOAD_BASE_S + max_bytes / DOWNLOAD_BYTES_PER_S
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.partial-{uuid.uuid4().hex}"
    digest, total = hashlib.sha256(), 0
    try:
        with (
            urllib.request.urlopen(url, timeout=SOCKET_TIMEOUT_S) as response,  # noqa: S310 - torchvision's URL
            open(partial, "wb") as out,
        ):
            while chunk := response.read(_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise WeightsError(
                        f"{redact_url(url)} sends more than {max_bytes} bytes, more than "
                        "torchvision lists for this file; not kept"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"downloading {redact_url(url)} took too long")
                digest.update(chunk)
                out.write(chunk)
        if not digest.hexdigest().startswith(expected):
            raise WeightsError(
                f"{redact_url(url)} sent a file whose SHA-256 {digest.hexdigest()[:16]}... "
                f"is not {expected}... as its name says; not kept, retry later"
            )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _hash_prefix(url: str) -> str:
    match = torch.hub.HASH_REGEX.search(os.path.basename(urlparse(url).path))
    if not match or len(match.group(1)) < 8:
        raise WeightsError(
            f"{redact_url(url)} has no SHA-256 prefix in its file name (<name>-<hash>.pth), "
            "so its contents cannot be checked; pass weights=<URI> of a state_dict instead"
        )
    return match.group(1)
