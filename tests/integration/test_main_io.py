"""The other ranks wait for rank 0's IO beating, past the group's timeout (main_io).

Real torch TCPStores on 127.0.0.1; the last test runs a real 2-process gloo group.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpflow.distributed.context import RankSpec, process_group
from ddpflow.distributed.main_io import FAILED, OK, MainIO, MainRankFailed, _wait_for_word
from infra.procs import free_port

pytestmark = pytest.mark.integration


def store_pair(timeout_s: float = 5.0) -> tuple[dist.TCPStore, dist.TCPStore]:
    port = free_port()
    timeout = timedelta(seconds=timeout_s)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout)
    return server, client


def say_later(store: dist.TCPStore, key: str, word: bytes, after_s: float) -> None:
    threading.Timer(after_s, store.set, args=(key, word)).start()


def test_a_peer_waits_for_rank_0_beating_and_goes_on_when_it_says_ok():
    server, client = store_pair(timeout_s=0.5)  # the store's own timeout does not bound it
    beats = []
    say_later(server, "k", OK, after_s=1.5)
    started = time.monotonic()
    _wait_for_word(MainIO(client, bound_s=30), "k", "checkpoint", lambda: beats.append(1))
    assert 1.4 < time.monotonic() - started < 5
    assert len(beats) >= 4, "the watchdog must see the waiting rank beat"


def test_a_peer_fails_at_once_naming_rank_0_when_rank_0_failed():
    server, client = store_pair()
    say_later(server, "k", FAILED, after_s=0.2)
    started = time.monotonic()
    with pytest.raises(MainRankFailed, match="rank 0 failed during its checkpoint"):
        _wait_for_word(MainIO(client, bound_s=30), "k", "checkpoint", lambda: None)
    assert time.monotonic() - started < 3


def test_a_peer_stops_waiting_at_its_bound_with_the_fix_named():
    _, client = store_pair()
    with pytest.raises(TimeoutError, match="DDPFLOW_STORE_OUTAGE_S or rank_timeout_s"):
        _wait_for_word(MainIO(client, bound_s=1.0), "never", "checkpoint", lambda: None)


def _rank(rank: int, port: int, out: multiprocessing.Queue) -> None:
    import os

    os.environ["DDPFLOW_STORE_OUTAGE_S"] = "30"
    spec = RankSpec(rank, 2, "127.0.0.1", port, "gloo", timeout_s=2.0, launch_id="t")
    said = []
    try:
        with process_group(spec) as ctx:
            with ctx.rank0_io("checkpoint"):
                if ctx.is_main:
                    time.sleep(5.0)  # a checkpoint write retried through a store outage
            dist.barrier()  # the group still works afterwards
            said.append("ok")
            with ctx.rank0_io("checkpoint"):
                if ctx.is_main:
                    raise OSError("store down for good")
            said.append("ok")
    except Exception as error:  # noqa: BLE001 - reported to the test
        said.append(f"{type(error).__name__}: {error}")
    out.put((rank, said))


def test_a_real_group_outlasts_its_timeout_while_rank_0_writes_and_learns_its_failure():
    """Rank 0 takes 5 s inside rank0_io in a group whose timeout is 2 s: a plain barrier
    there fails with gloo's timeout; the store wait goes on. Then rank 0's write fails and
    rank 1 raises MainRankFailed at once instead of timing out."""
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    port = free_port()
    procs = [mp.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    said = dict(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert said[0] == ["ok", "OSError: store down for good"]
    assert said[1][0] == "ok", said[1]
    assert said[1][1].startswith("MainRankFailed: rank 0 failed during its checkpoint")
