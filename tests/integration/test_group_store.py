"""The group's store stays with the group (ddpflow/distributed/group_store.py): rank 0 listens
on one address, every name and value is sealed with the launch's token
(ddpflow/distributed/sealed_store.py), and the token is in no error.

Real torch TCPStores on 127.0.0.1, in this process; a 2-rank group over the launcher is in
tests/integration/test_store_privacy.py.
"""

from __future__ import annotations

import errno
import re
import socket
import threading
import traceback
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpflow.distributed.context import RankSpec, process_group
from ddpflow.distributed.group_store import (
    HIDDEN,
    listening_socket,
    open_group_store,
    reserve_store_port,
    token_kept_out_of_errors,
)
from ddpflow.distributed.sealed_store import SealBroken
from infra.procs import free_port
from tests.helpers.listeners import listening_addresses

pytestmark = pytest.mark.integration

TOKEN = "0123456789abcdef0123456789abcdef"
SECOND = timedelta(seconds=1)


def test_torch_alone_listens_on_every_address_whatever_host_it_is_given():
    """Why group_store makes the socket itself: TCPStore's host is where clients connect."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=SECOND)
    assert listening_addresses(store.port) & {"::", "0.0.0.0"}


def test_rank_0s_store_listens_on_its_address_only_and_serves_the_group():
    port = free_port()
    server = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    assert listening_addresses(port) == {"127.0.0.1"}
    client = open_group_store("127.0.0.1", port, 1, False, SECOND * 5, TOKEN)
    server.set("k", b"v")
    assert client.get("k") == b"v"
    del server, client  # the store owns the socket: a long-lived worker keeps no listener
    assert listening_addresses(port) == set()


def test_the_port_rank_0s_worker_gives_the_launcher_is_held_until_rank_0_serves_on_it():
    """The launcher asks rank 0's worker for the store's port before the ranks start. A
    port only found free and released there could go to any other bind to port 0 on that
    host before rank 0 binds it (another group's gloo pairs, a Dask comm), and the group
    would fail to form; the reserved port stays bound, and rank 0's store serves on that
    very socket."""
    port = reserve_store_port("127.0.0.1")
    assert listening_addresses(port) == {"127.0.0.1"}
    with socket.socket() as intruder, pytest.raises(OSError) as taken:
        intruder.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    server = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    client = open_group_store("127.0.0.1", port, 1, False, SECOND * 5, TOKEN)
    server.set("k", b"v")
    assert client.get("k") == b"v"
    del server, client
    assert listening_addresses(port) == set(), "the store took the reserved socket along"


def test_a_listening_socket_binds_an_ipv6_address_too():
    with listening_socket("::1", 0) as sock:
        assert listening_addresses(sock.getsockname()[1]) == {"::1"}


def test_no_name_or_value_the_group_uses_is_stored_in_the_clear():
    port = free_port()
    group = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    group.set("ddpflow/main-io/0/checkpoint", b"ok")
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SECOND)
    assert not raw.check(["ddpflow/main-io/0/checkpoint"])
    assert not raw.check([f"{TOKEN}/ddpflow/main-io/0/checkpoint"])
    (name,) = raw.list_keys()
    assert name == group.sealed_name("ddpflow/main-io/0/checkpoint")
    assert b"ok" not in raw.get(name)
    assert group.get("ddpflow/main-io/0/checkpoint") == b"ok"


# The keys a gloo group and main_io write, with values as readable as theirs.
GROUP_VALUES = {
    "default_pg/0//cpu//0/0": b"127.0.0.1:41234 rank 0 address",
    "ddpflow/main-io/0/checkpoint": b"ok",
}


def _group_and_a_stranger() -> tuple[dist.Store, dist.TCPStore]:
    """A group's store holding GROUP_VALUES, and a plain client of its port."""
    port = free_port()
    group = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    for key, value in GROUP_VALUES.items():
        group.set(key, value)
    return group, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SECOND)


def test_a_stranger_who_lists_the_keys_learns_nothing_of_the_group():
    _, stranger = _group_and_a_stranger()
    listed = stranger.list_keys()
    assert len(listed) == len(GROUP_VALUES)
    seen = " ".join(listed) + repr([stranger.get(name) for name in listed])
    assert TOKEN not in seen
    for key, value in GROUP_VALUES.items():
        assert key not in seen and value.decode() not in seen
        assert not any(part in seen for part in key.split("/") if len(part) > 3)


def test_what_a_stranger_writes_under_a_listed_name_is_refused_not_believed():
    group, stranger = _group_and_a_stranger()
    checkpoint, rendezvous = group.sealed_name("ddpflow/main-io/0/checkpoint"), None
    for name in stranger.list_keys():
        if name != checkpoint:
            rendezvous = name
    # A sealed value moved to another name, and a value of the stranger's own.
    stranger.set(checkpoint, stranger.get(rendezvous))
    stranger.set(rendezvous, b"failed")
    for key in GROUP_VALUES:
        with pytest.raises(SealBroken, match=re.escape(repr(key))):
            group.get(key)


def test_a_stranger_cannot_write_a_key_the_group_will_read():
    """The names of keys not yet written are unknown outside the group: forging one by its
    plain name, or under the token as a prefix, leaves the group's key unset."""
    port = free_port()
    group = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SECOND)
    future = "ddpflow/main-io/1/checkpoint"
    stranger.set(future, b"failed")
    stranger.set(f"{TOKEN}/{future}", b"failed")
    assert not group.check([future])
    with pytest.raises(dist.DistStoreError, match=re.escape(future)) as info:
        group.wait([future], timedelta(seconds=0.3))
    assert group.sealed_name(future) not in str(info.value), "errors name keys plainly"


def test_the_sealed_store_keeps_the_store_api():
    port = free_port()
    group = open_group_store("127.0.0.1", port, 1, True, SECOND * 5, TOKEN)
    assert group.add("count", 2) == 2 and group.add("count", 3) == 5
    assert group.compare_set("word", "", "first") == b"first"  # not there yet: set
    assert group.compare_set("word", "first", "second") == b"second"
    assert group.compare_set("word", "stale", "third") == b"second"  # no match: unchanged
    group.multi_set(["a", "b"], [b"1", b""])
    assert group.multi_get(["a", "b"]) == [b"1", b""]
    assert group.check(["a", "b", "word"]) and group.num_keys() >= 4
    assert group.delete_key("a") and not group.check(["a"])
    clone = group.clone()
    assert clone.get("word") == b"second"
    assert TOKEN not in repr(group)


def test_the_rank_spec_shows_no_token():
    """Dask logs a failed task with the repr of its arguments, the spec among them."""
    spec = RankSpec(0, 2, "127.0.0.1", 1, "gloo", 5.0, "t", store_token=TOKEN)
    assert TOKEN not in repr(spec) and TOKEN not in str(spec)


def test_a_group_whose_peer_never_joins_fails_without_naming_the_token(capfd):
    """Rank 1 connects to the store but never joins the group: rank 0's rendezvous times out
    with torch's error, which names the key it waited for by its plain name."""
    port = free_port()
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
    assert "default_pg/0//cpu//0/1" in text, "the error names the key it waited for"
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
