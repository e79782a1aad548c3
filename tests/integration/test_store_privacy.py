"""A 2-rank group's store on a real LocalCluster: a stranger who reaches rank 0's port can
neither read nor set the keys the group uses by their names, finds only sealed names and
values when it lists the store, cannot steer the group by overwriting them, the store
listens on rank 0's worker address only, and the launch's token shows in no error or log.

Each group holds after forming (and after one round of main_io) until the test has looked;
rank 0 publishes its store's host and port through a Dask Variable.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from urllib.parse import urlsplit

import distributed
import pytest
import torch
import torch.distributed as dist

from ddpflow.distributed import LaunchError, RankContext, cluster_workers, launch
from ddpflow.distributed.main_io import FAILED
from tests.helpers.listeners import listening_addresses

pytestmark = pytest.mark.integration

# The keys a 2-rank gloo group and one round of main_io write, as the group names them:
# gloo's rendezvous (one per rank) and rank 0's word on its first checkpoint.
GROUP_KEYS = [
    "default_pg/0//cpu//0/0",
    "default_pg/0//cpu//0/1",
    "ddpflow/main-io/0/checkpoint",
]
NEXT_WORD = "ddpflow/main-io/1/checkpoint"  # the word rank 1 waits for after the stranger
COUNTER = "default_pg/0//cpu//0/2"  # a counter the stranger adds to
STRANGER_TIMEOUT = timedelta(seconds=0.2)
TOKEN = "0123456789abcdef0123456789abcdef"


def _meet_a_stranger(ctx: RankContext, address: str, resume: str) -> dict:
    """One main_io round, publish the store's address (rank 0), hold until `resume`, then a
    second round (whose word the stranger forged, by name) and an all_reduce."""
    client = distributed.get_client()
    with ctx.rank0_io("checkpoint"):
        pass
    assert ctx.main_io is not None
    store = ctx.main_io.store
    assert store.check(GROUP_KEYS), "the key names above are the ones the group uses"
    before = {key: store.get(key) for key in GROUP_KEYS}
    if ctx.is_main:
        tcp = getattr(store, "underlying_store", store)  # the TCPStore under the seal
        distributed.Variable(address, client=client).set([tcp.host, tcp.port])
    done = distributed.Event(resume, client=client)
    while not done.wait(0.2):
        ctx.heartbeat()
    unchanged = {key: store.get(key) for key in GROUP_KEYS} == before
    with ctx.rank0_io("checkpoint"):  # rank 1 raises MainRankFailed if it reads "failed"
        if ctx.is_main:
            time.sleep(1.0)  # a checkpoint write: rank 1 polls for its word meanwhile
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return {"unchanged": unchanged, "sum": float(value)}


@contextmanager
def held_group(client: distributed.Client, forged: bool = False) -> Iterator[tuple[str, int]]:
    """A 2-rank group launched in the background and held: yields rank 0's store (host,
    port); on exit lets the group go on, then checks that it finished and trained right
    (or, `forged`, that it failed on reading what the stranger wrote)."""
    address, resume = (f"store-{name}-{uuid.uuid4().hex}" for name in ("address", "resume"))
    results: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            results.append(
                launch(client, _meet_a_stranger, address, resume, world_size=2, timeout_s=30)
            )
        except BaseException as failure:  # noqa: BLE001 - reported by the test
            error.append(failure)

    launcher = threading.Thread(target=run, daemon=True)
    launcher.start()
    try:
        host, port = distributed.Variable(address, client=client).get(timeout=60)
        yield host, int(port)
    finally:
        distributed.Event(resume, client=client).set()
        launcher.join(timeout=90)
    assert not launcher.is_alive(), "the group did not finish"
    if forged:
        assert results == [] and len(error) == 1, "a forged value must stop the group"
        assert isinstance(error[0], LaunchError), repr(error[0])
        assert "SealBroken" in str(error[0]) and "this launch did not write" in str(error[0])
        return
    assert error == [], f"the group failed: {error}"
    rank0, rank1 = results[0]
    assert rank0["unchanged"] and rank1["unchanged"], "the group's keys kept their values"
    assert rank0["sum"] == rank1["sum"] == 3.0


def test_a_stranger_cannot_read_or_set_the_groups_keys_and_training_goes_on(
    dask_client, monkeypatch
):
    """The stranger knows every key name the group uses, not the launch's token: it reads
    none, and what it writes under those names changes nothing. Its last write forges rank
    0's failure at the next checkpoint: had it landed, rank 1 would give up at once
    (MainRankFailed) and the launch would fail. Listing the store shows it only sealed
    names and values."""
    monkeypatch.setattr("ddpflow.distributed.launcher.new_store_token", lambda: TOKEN)
    with held_group(dask_client) as (host, port):
        stranger = dist.TCPStore(host, port, is_master=False, timeout=STRANGER_TIMEOUT)
        for key in [*GROUP_KEYS, NEXT_WORD]:
            assert not stranger.check([key]), key
            with pytest.raises(dist.DistStoreError):
                stranger.get(key)
            with pytest.raises(dist.DistStoreError):
                stranger.wait([key], STRANGER_TIMEOUT)
            assert not stranger.delete_key(key), key
        for key in [*GROUP_KEYS, NEXT_WORD]:
            stranger.set(key, b"ok")
            stranger.compare_set(key, b"ok", b"failed")
            stranger.append(key, b"-forged")
        stranger.add(COUNTER, 1)
        stranger.multi_set([NEXT_WORD], [FAILED])
        assert stranger.num_keys() >= len(GROUP_KEYS) + 2
        # The store's own API lists every name it holds: the group's are sealed, names and
        # values, and the token is in none of them.
        own = {*GROUP_KEYS, NEXT_WORD, COUNTER}  # what the stranger wrote itself
        listed = [name for name in stranger.list_keys() if name not in own]
        assert len(listed) >= len(GROUP_KEYS)
        values = [stranger.get(name) for name in listed]
        seen = " ".join(listed) + repr(values)
        assert TOKEN not in seen and host not in seen, seen
        words = {part for key in GROUP_KEYS for part in key.split("/") if len(part) > 3}
        assert not any(word in seen for word in words), seen
        assert FAILED not in values and b"ok" not in values


def test_what_a_stranger_writes_under_a_listed_name_stops_the_group_and_says_why(
    dask_client, monkeypatch
):
    """A stranger who lists the store and overwrites every name it holds cannot steer the
    group: the next read of a forged value fails the launch (SealBroken) instead."""
    monkeypatch.setattr("ddpflow.distributed.launcher.new_store_token", lambda: TOKEN)
    with held_group(dask_client, forged=True) as (host, port):
        stranger = dist.TCPStore(host, port, is_master=False, timeout=STRANGER_TIMEOUT)
        for name in stranger.list_keys():
            stranger.set(name, FAILED)


def test_rank_0s_store_listens_on_its_workers_address_only(dask_client):
    with held_group(dask_client) as (host, port):
        addresses = listening_addresses(port)
    workers = {urlsplit(address).hostname for address in cluster_workers(dask_client)}
    assert host in workers, f"the store's host {host} is no worker's ({workers})"
    assert addresses == {host}, f"port {port} listens on {addresses}, not only on {host}"


def _wait_for_a_key_never_set(ctx: RankContext) -> None:
    """Rank 1 fails with torch's store error, which names the key it waited for."""
    if ctx.rank == 1:
        assert ctx.main_io is not None
        ctx.main_io.store.wait(["never-set"], timedelta(seconds=1))
    dist.barrier()


def _log_rank_failures(dask_worker, log: bool) -> None:
    """On a worker: let Dask's "Compute Failed" record of a rank task through (`log`), or
    drop it again as the launcher does."""
    from ddpflow.distributed import launcher

    worker_log = logging.getLogger("distributed.worker")
    for record_filter in list(worker_log.filters):
        if isinstance(record_filter, launcher._RankFailureRecord):
            worker_log.removeFilter(record_filter)
    if log:
        launcher._quiet_before_test = launcher._quiet_rank_failures  # type: ignore[attr-defined]
        launcher._quiet_rank_failures = lambda: None  # the next launch installs no filter
    elif hasattr(launcher, "_quiet_before_test"):
        launcher._quiet_rank_failures = launcher.__dict__.pop("_quiet_before_test")


def test_the_token_shows_in_no_error_or_log_of_a_failed_launch(dask_client, monkeypatch, caplog):
    """The launcher drops the workers' "Compute Failed" record of a rank for readability,
    not secrecy: here the workers log it, task and error, and it must not hold the token."""
    monkeypatch.setattr("ddpflow.distributed.launcher.new_store_token", lambda: TOKEN)
    caplog.set_level("DEBUG")
    dask_client.run(_log_rank_failures, log=True)
    try:
        with pytest.raises(LaunchError) as info:
            launch(dask_client, _wait_for_a_key_never_set, world_size=2, timeout_s=30)
    finally:
        dask_client.run(_log_rank_failures, log=False)
    message = str(info.value)
    assert "keys: /never-set" in message, message  # torch's error came through, key named
    assert TOKEN not in message
    assert TOKEN not in caplog.text
    workers = str(dask_client.get_worker_logs()) + str(dask_client.get_scheduler_logs())
    assert "never-set" in workers, "the failed rank's worker logged its error"
    assert TOKEN not in workers
