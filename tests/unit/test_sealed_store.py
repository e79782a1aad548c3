"""The sealed store's cipher (ddpflow/distributed/sealed_store.py) is cryptography's AES-SIV,
keyed from the launch's token, on torch's in-process HashStore; the same store over a real
TCPStore, and a stranger on its port, are in tests/integration/test_group_store.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ddpflow.distributed.sealed_store import SealBroken, SealedStore

TOKEN = "0123456789abcdef0123456789abcdef"
KEY = "ddpflow/main-io/0/checkpoint"


def _sealed() -> tuple[SealedStore, dist.HashStore]:
    raw = dist.HashStore()
    return SealedStore(raw, TOKEN), raw


def test_a_stored_value_is_rfc_5297_aes_siv_under_a_key_drawn_from_the_token():
    """Anyone holding the token opens a value with the standard primitive alone: nothing
    home-made sits between the token and the stored bytes."""
    store, raw = _sealed()
    store.set(KEY, b"ok")
    key = HKDF(
        algorithm=hashes.SHA256(), length=64, salt=None, info=b"ddpflow group store: values"
    ).derive(TOKEN.encode())
    opened = AESSIV(key).decrypt(raw.get(store.sealed_name(KEY)), [KEY.encode()])
    assert opened == b"\x01ok"


@pytest.mark.parametrize("value", [b"", b"ok", "text", bytes(range(256)) * 5])
def test_values_round_trip_and_seal_to_the_same_bytes_each_time(value):
    """Deterministic, as compare_set needs (the server compares sealed bytes)."""
    store, raw = _sealed()
    store.set(KEY, value)
    first = raw.get(store.sealed_name(KEY))
    assert store.get(KEY) == (value.encode() if isinstance(value, str) else value)
    store.set(KEY, value)
    assert raw.get(store.sealed_name(KEY)) == first


def test_what_the_token_did_not_seal_for_that_name_is_refused():
    store, raw = _sealed()
    other = SealedStore(raw, "f" * 32)
    name = store.sealed_name(KEY)
    forgeries = {
        "another launch's seal": other.seal(KEY, b"failed"),
        "a seal moved from another name": store.seal("ddpflow/main-io/1/checkpoint", b"ok"),
        "a seal cut short": store.seal(KEY, b"ok")[:10],
        "a seal with a bit flipped": bytes([store.seal(KEY, b"ok")[0] ^ 1])
        + store.seal(KEY, b"ok")[1:],
        "nothing": b"",
    }
    for what, forged in forgeries.items():
        raw.set(name, forged)
        with pytest.raises(SealBroken, match=KEY):
            store.get(KEY)
            pytest.fail(f"{what} was believed")


def test_another_token_gives_other_names():
    """Nothing carries over from one launch to the next."""
    store, raw = _sealed()
    assert store.sealed_name(KEY) != SealedStore(raw, "f" * 32).sealed_name(KEY)
    assert KEY not in store.sealed_name(KEY) and len(store.sealed_name(KEY)) == 32
