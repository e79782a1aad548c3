"""The group's store stays with the group (ddpflow/distributed/group_store.py): rank 0 listens
on one address, every key sits under the launch's token, and the token is in no error.

Real torch TCPStores on 127.0.0.1, in this process; a 2-rank group over the launcher is in
tests/integration/test_store_privacy.py.
"""

from __future__ import annotations

import threading
import traceback
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpflow.distributed.context import RankSpec, find_free_port, process_group
from ddpflow.distributed.group_store import (
    HIDDEN,
    listening_socket,
    open_group_store,
    token_kept_out_of_errors,
)
from tests.listeners import listening_addresses

pytestmark = pytest.mark.integration

TOKEN = "0123456789abcdef0123456789abcdef"
SECOND = timedelta(seconds=1)


def test_torch_alone_listens_on_every_address_whatever_host_it_is_given():
    """Why group_store makes the socket itself: TCPStore's host is where clients connect."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=SECOND)
    assert listening_addresses(store.port) & {"::", "0.0.0.0"}


def test_rank_0s_store_listens_on_its_address_only_and_serves_the_group():
    port = find_free_port()
    server = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    assert listening_addresses(port) == {"127.0.0.1"}
    client = open_group_store("127.0.0.1", port, 1, False, SECOND * 5, TOKEN)
    server.set("k", b"v")
    assert client.get("k") == b"v"
    del server, client  # the store owns the socket: a long-lived worker keeps no listener
    assert listening_addresses(port) == set()


def test_a_listening_socket_binds_an_ipv6_address_too():
    with listening_socket("::1", 0) as sock:
        assert listening_addresses(sock.getsockname()[1]) == {"::1"}


def test_every_key_sits_under_the_token():
    port = find_free_port()
    group = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    group.set("ddpflow/main-io/0/checkpoint", b"ok")
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SECOND)
    assert not raw.check(["ddpflow/main-io/0/checkpoint"])
    assert raw.get(f"{TOKEN}/ddpflow/main-io/0/checkpoint") == b"ok"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="TCPStore answers list_keys() to any client: the prefix hides the group's keys "
    "from a stranger who guesses names, not from one who lists them (docs/security.md)",
)
def test_a_stranger_who_lists_the_keys_learns_nothing_of_the_group():
    port = find_free_port()
    group = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    group.set("ddpflow/main-io/0/checkpoint", b"ok")
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SECOND)
    assert not any(TOKEN in key for key in stranger.list_keys())


def test_the_rank_spec_shows_no_token():
    """Dask logs a failed task with the repr of its arguments, the spec among them."""
    spec = RankSpec(0, 2, "127.0.0.1", 1, "gloo", 5.0, "t", store_token=TOKEN)
    assert TOKEN not in repr(spec) and TOKEN not in str(spec)


def test_a_group_whose_peer_never_joins_fails_without_naming_the_token(capfd):
    """Rank 1 connects to the store but never joins the group: rank 0's rendezvous times out
    with torch's error, which names the key it waited for, prefix and all."""
    port = find_free_port()
    spec = RankSpec(
        0, 2, "127.0.0.1", port, "gloo", 2.0, "t", bind_host="127.0.0.1", store_token=TOKEN
    )
    peer: list[dist.Store] = []  # kept alive until the end: its connection counts as joined
    joiner = threading.Thread(
        target=lambda: peer.append(open_group_store("127.0.0.1", port, 2, False, SECOND * 5, TOKEN))
    )
    joiner.start()
    # Whatever torch raises (DistStoreError today): what matters is its text.
    with pytest.raises(Exception) as info, process_group(spec):  # noqa: PT011
        pass
    joiner.join()
    text = "".join(traceback.format_exception(info.value))
    assert f"{HIDDEN}/default_pg" in text, "the error names the key it waited for"
    assert TOKEN not in text and TOKEN not in repr(info.value)
    out, err = capfd.readouterr()
    assert TOKEN not in out + err, "torch's own log lines name no key"


def test_an_error_keeps_its_type_and_loses_the_token_in_its_causes_and_notes():
    with pytest.raises(KeyError) as info, token_kept_out_of_errors(TOKEN):
        try:
            raise RuntimeError(f"wait timeout, keys: /{TOKEN}/x")
        except RuntimeError as cause:
            error = KeyError(f"{TOKEN}/y")
            error.add_note(f"while waiting for {TOKEN}")
            raise error from cause
    text = "".join(traceback.format_exception(info.value))
    assert TOKEN not in text
    assert f"{HIDDEN}/x" in text and f"{HIDDEN}/y" in text and f"for {HIDDEN}" in text


class _OwnText(Exception):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def __str__(self) -> str:
        return f"no key {self.key}"


def test_an_error_whose_text_is_not_its_args_is_replaced_by_its_words():
    with (
        pytest.raises(RuntimeError, match=r"_OwnText: no key \*\*\*/x") as info,
        token_kept_out_of_errors(TOKEN),
    ):
        raise _OwnText(f"{TOKEN}/x")
    assert TOKEN not in "".join(traceback.format_exception(info.value))


def test_without_a_token_errors_pass_untouched():
    error = ValueError("plain")
    with pytest.raises(ValueError) as info, token_kept_out_of_errors(None):
        raise error
    assert info.value is error
