"""A key-value store whose names and values are sealed with the launch's token.

A TCPStore serves anyone who reaches its port, `list_keys()` included, so a prefix alone
hides nothing from a stranger who lists the keys (group_store's docstring). The group
therefore talks to rank 0's store through this wrapper:

- Keys: two independent keys are drawn from the token with HKDF-SHA256 (RFC 5869), one
  per use below, so neither use can be turned against the other.
- Names: each key is stored under HMAC-SHA256(name key, name), 128 bits in hex. A listed
  name says nothing of the key, and a stranger cannot compute the name of a key the group
  will read next (a forged `ddpflow/main-io/1/checkpoint` lands under a name nobody reads).
- Values: AES-SIV (RFC 5297, `cryptography`'s AESSIV), a deterministic authenticated
  cipher, with the key's plain name as associated data. A stranger who reads a value learns
  nothing of it, and a value written by anyone without the token, or a sealed value moved
  to another name, fails its check and raises `SealBroken`, naming the key, instead of
  being believed. Deterministic, so that compare_set, which the server decides by comparing
  bytes, still works.
- Counters (`add`) are plain integers on the server, as they must be for it to add; their
  names are sealed. A stranger can still delete or overwrite any listed entry: that stops
  the group (a rank fails with SealBroken or times out), it cannot steer it.

gloo's rendezvous and process groups use set, get and wait (checked on torch 2.14);
main_io uses set, get and check. What a store cannot seal (append, the queues) raises.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

NAME_BYTES = 16
NAME_KEY_BYTES = 32  # as long as HMAC-SHA256's output
SIV_KEY_BYTES = 64  # AES-256-SIV: a CMAC key and a CTR key of 256 bits each
# Put before every plain value: it names this format, and it keeps the plaintext non-empty,
# as older cryptography releases require of AESSIV (the group may store an empty value).
FORMAT = b"\x01"


class SealBroken(RuntimeError):
    """A value in the group's store was not sealed by this launch: someone without the
    token wrote it."""


def _derive(token: str, purpose: bytes, length: int) -> bytes:
    """A key for one `purpose`, independent of the others drawn from the same token."""
    info = b"ddpflow group store: " + purpose
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(
        token.encode()
    )


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """`underlying_store` with every name HMACed and every value sealed under `token`."""

    def __init__(self, underlying_store: dist.Store, token: str) -> None:
        super().__init__()
        self.underlying_store = underlying_store
        self._token = token
        self._name_key = _derive(token, b"names", NAME_KEY_BYTES)
        self._cipher = AESSIV(_derive(token, b"values", SIV_KEY_BYTES))

    def __repr__(self) -> str:  # the token stays out of any log of this object
        return f"SealedStore({self.underlying_store!r})"

    def sealed_name(self, key: str) -> str:
        """The name `key` is stored under."""
        return hmac.digest(self._name_key, key.encode(), "sha256")[:NAME_BYTES].hex()

    def seal(self, key: str, value: bytes | str) -> bytes:
        # No nonce: the same (key, value) seals to the same bytes, which compare_set needs.
        # The key's plain name as associated data ties the value to it: moved under another
        # name, it fails to open.
        return self._cipher.encrypt(FORMAT + _as_bytes(value), [key.encode()])

    def unseal(self, key: str, sealed: bytes) -> bytes:
        try:
            plain: bytes | None = self._cipher.decrypt(sealed, [key.encode()])
        except InvalidTag:  # forged, moved from another name, or cut short
            plain = None
        if plain is None or not plain.startswith(FORMAT):
            raise SealBroken(
                f"the group's store holds a value for {key!r} that this launch did not write: "
                "someone without the launch's token wrote to rank 0's store. Keep the "
                "workers' network private (docs/security.md, 'What a training opens on the "
                "network')"
            )
        return plain[len(FORMAT) :]

    @contextmanager
    def _named_errors(self, keys: Sequence[str]) -> Iterator[None]:
        """torch's store errors name the keys they waited for: name ours, not their seals."""
        try:
            yield
        except dist.DistStoreError as error:
            text = str(error)
            for key in keys:
                text = text.replace(self.sealed_name(key), key)
            raise type(error)(text) from None

    # The store API, as torch's Python stores define it.
    def set(self, key: str, value: bytes | str) -> None:
        sealed = self.seal(key, value)
        # torch's stub says str; the binding takes bytes as well (set, compare_set).
        self.underlying_store.set(self.sealed_name(key), sealed)  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        with self._named_errors([key]):
            sealed = self.underlying_store.get(self.sealed_name(key))
        return self.unseal(key, sealed)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self.sealed_name(key), amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        # An empty expected value means "not there yet" to the server: it stays empty.
        wanted = self.seal(key, expected) if _as_bytes(expected) else b""
        current = self.underlying_store.compare_set(
            self.sealed_name(key),
            wanted,  # type: ignore[arg-type]
            self.seal(key, desired),  # type: ignore[arg-type]
        )
        return self.unseal(key, current) if current else current

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self.sealed_name(key) for key in keys]
        with self._named_errors(keys):
            if timeout is None:
                self.underlying_store.wait(names)
            else:
                self.underlying_store.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.underlying_store.check([self.sealed_name(key) for key in keys])

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self.sealed_name(key))

    def num_keys(self) -> int:
        return self.underlying_store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.underlying_store.set_timeout(timeout)

    def clone(self) -> SealedStore:
        return SealedStore(self.underlying_store.clone(), self._token)
