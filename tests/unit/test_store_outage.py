"""Checkpoint writes through a store outage: retried with backoff for a bounded time, the
`latest` pointer never ahead of a complete checkpoint, a clear failure past the bound.

The store is a local folder; the outage is storage.write_bytes failing (ConnectionError, as
an unreachable endpoint does) for a while. Time is a fake clock that sleeping advances, so
minutes of outage take milliseconds.
"""

from __future__ import annotations

import errno
import json
import logging
import types
from collections.abc import Callable

import pytest

from ddpflow import storage
from ddpflow.checkpoint import store as checkpoint
from ddpflow.checkpoint.store import CheckpointStore, encode
from ddpflow.config import STORE_OUTAGE_ENV, ConfigError, Settings, store_outage_s
from ddpflow.distributed.supervisor import heartbeats
from ddpflow.storage.retry import OutageTooLong, retry_for


class FakeTime:
    """time.monotonic and time.sleep of a clock that only sleeping moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Outage:
    """storage.write_bytes that fails while `down(uri)` says the store is down."""

    def __init__(self, down: Callable[[str], bool], clock: FakeTime):
        self.down, self.clock = down, clock
        self.real = storage.write_bytes
        self.attempts: list[tuple[str, float]] = []

    def __call__(self, uri: str, data: bytes) -> None:
        self.attempts.append((uri.rsplit("/", 1)[-1], self.clock.now))
        if self.down(uri):
            raise ConnectionError(f"Could not connect to http://user:pw-secret@s3.test/{uri}")
        self.real(uri, data)


@pytest.fixture
def fake_time(monkeypatch) -> FakeTime:
    clock = FakeTime()
    fake = types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep)
    monkeypatch.setattr(checkpoint, "time", fake)
    return clock


def outage(monkeypatch, clock: FakeTime, down: Callable[[str], bool]) -> Outage:
    fake = Outage(down, clock)
    monkeypatch.setattr(storage, "write_bytes", fake)
    return fake


def state(epoch: int) -> dict:
    return {"epoch": epoch, "weights": [float(epoch)]}


def pointer(store: CheckpointStore) -> dict:
    return json.loads(storage.read_bytes(storage.join(store.root, "latest.json"), 2**16))


# --- retry_for -------------------------------------------------------------------------------


def test_retry_for_waits_out_an_outage_with_doubling_capped_pauses():
    clock, beats = FakeTime(), []
    calls = iter([ConnectionError(), TimeoutError(), OSError(), OSError(), OSError(), "ok"])

    def fn() -> str:
        result = next(calls)
        if isinstance(result, BaseException):
            raise result
        return result

    got = retry_for(
        fn, what="w", bound_s=60, hint="h", base_delay_s=1, max_delay_s=5,
        on_wait=lambda: beats.append(clock.now), sleep=clock.sleep, clock=clock.monotonic,
    )  # fmt: skip
    assert got == "ok"
    assert clock.sleeps == [1, 2, 4, 5, 5]
    assert len(beats) == 2 * len(clock.sleeps), "a heartbeat before and after each pause"


def test_retry_for_gives_up_at_the_bound_naming_what_and_the_hint():
    clock = FakeTime()
    attempts: list[float] = []

    def fn() -> None:
        attempts.append(clock.now)
        raise ConnectionError("http://AKIAIOSFODNN7EXAMPLE:s3cr3t@host/x refused")

    with pytest.raises(OutageTooLong) as info:
        retry_for(
            fn, what="write of s3://bucket/k", bound_s=20, hint="raise THE_SETTING",
            sleep=clock.sleep, clock=clock.monotonic,
        )  # fmt: skip
    message = str(info.value)
    assert "write of s3://bucket/k" in message and "raise THE_SETTING" in message
    assert "after 20 s" in message and "s3cr3t" not in message
    assert isinstance(info.value.__cause__, ConnectionError)
    assert attempts[-1] == 20, "the last attempt is made at the bound, not before it"


def test_retry_for_raises_a_permanent_error_at_once():
    clock = FakeTime()
    with pytest.raises(PermissionError):
        retry_for(
            lambda: (_ for _ in ()).throw(PermissionError("denied")), what="w", bound_s=60,
            hint="h", sleep=clock.sleep, clock=clock.monotonic,
        )  # fmt: skip
    assert clock.sleeps == []


# --- CheckpointStore.save_encoded ------------------------------------------------------------


def test_a_checkpoint_write_waits_out_a_one_minute_outage(tmp_path, monkeypatch, fake_time, caplog):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(state(1))
    fake = outage(monkeypatch, fake_time, lambda uri: fake_time.now < 60)
    heartbeats.rank_started("launch-outage", 0)
    heartbeats.bind_thread("launch-outage", 0)
    try:
        with caplog.at_level(logging.WARNING, logger="ddpflow.storage.retry"):
            store.save_encoded(2, encode(state(2)))
        _, beats = heartbeats.rank_progress("launch-outage")[0]
    finally:
        heartbeats.unbind_thread()
    assert pointer(store) == {"uri": store.uri_for(2), "epoch": 2}
    assert store.load()["epoch"] == 2
    first_ok = next(t for name, t in fake.attempts if name == "epoch-0002.pt" and t >= 60)
    assert first_ok <= 60 + 15, "the write went through within one pause of the store's return"
    assert beats >= len(fake_time.sleeps), "rank 0 beat during the outage (no hang to see)"
    assert "retrying" in caplog.text and "epoch-0002.pt" in caplog.text
    assert "pw-secret" not in caplog.text


def test_an_outage_past_the_bound_fails_and_latest_stays_on_the_previous_checkpoint(
    tmp_path, monkeypatch, fake_time
):
    monkeypatch.setenv(STORE_OUTAGE_ENV, "45")
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(state(1))
    fake = outage(monkeypatch, fake_time, lambda uri: True)
    with pytest.raises(OutageTooLong) as info:
        store.save_encoded(2, encode(state(2)))
    message = str(info.value)
    assert store.uri_for(2) in message and f"raise {STORE_OUTAGE_ENV} (now 45 s)" in message
    assert "pw-secret" not in message
    assert 45 <= fake_time.now < 45 + 1, "it waited the whole bound, and no longer"
    assert {name for name, _ in fake.attempts} == {"epoch-0002.pt"}, "no pointer write"
    assert pointer(store) == {"uri": store.uri_for(1), "epoch": 1}
    assert store.load()["epoch"] == 1


def test_a_pointer_write_that_fails_leaves_latest_on_the_previous_checkpoint(
    tmp_path, monkeypatch, fake_time
):
    monkeypatch.setenv(STORE_OUTAGE_ENV, "30")
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(state(1))
    outage(monkeypatch, fake_time, lambda uri: uri.endswith("latest.json"))
    with pytest.raises(OutageTooLong, match="latest.json"):
        store.save_encoded(2, encode(state(2)))
    assert fake_time.now < 30 + 1, "the object and the pointer share one window"
    assert store.load()["epoch"] == 1
    assert store.load(store.uri_for(2))["epoch"] == 2, "the new one is complete, not pointed at"


def test_in_a_group_rank_0_waits_the_whole_window_past_the_group_timeout(
    tmp_path, monkeypatch, fake_time
):
    """The other ranks wait for rank 0 beating (main_io), so nothing about the group cuts
    rank 0's window (200 s) short: its write waits the whole window."""
    monkeypatch.setenv(STORE_OUTAGE_ENV, "200")
    store = CheckpointStore(str(tmp_path / "ckpt"))
    outage(monkeypatch, fake_time, lambda uri: True)
    heartbeats.rank_started("launch-group", 0)
    heartbeats.bind_thread("launch-group", 0)
    try:
        with pytest.raises(OutageTooLong, match=STORE_OUTAGE_ENV):
            store.save_encoded(1, encode(state(1)))
    finally:
        heartbeats.unbind_thread()
    assert 200 - 31 <= fake_time.now <= 200 + 1
    assert store.latest_uri() is None


@pytest.mark.parametrize(
    "error",
    [
        PermissionError("access denied"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EROFS, "Read-only file system"),
    ],
)
def test_a_refusal_or_a_full_disk_is_not_waited_out(tmp_path, monkeypatch, fake_time, error):
    store = CheckpointStore(str(tmp_path / "ckpt"))

    def refused(uri: str, data: bytes) -> None:
        raise error

    monkeypatch.setattr(storage, "write_bytes", refused)
    with pytest.raises(OSError) as info:
        store.save_encoded(1, encode(state(1)))
    assert info.value is error
    assert fake_time.sleeps == []


# --- the setting -----------------------------------------------------------------------------


def test_the_outage_bound_defaults_to_five_minutes_and_is_read_from_the_environment():
    assert store_outage_s({}) == 300
    assert store_outage_s({STORE_OUTAGE_ENV: "90"}) == 90
    assert Settings.from_env({STORE_OUTAGE_ENV: "600"}).store_outage_s == 600


@pytest.mark.parametrize("raw", ["soon", "0", "-5", "inf"])
def test_a_bad_outage_bound_is_named(raw):
    with pytest.raises(ConfigError, match=rf"{STORE_OUTAGE_ENV}=.*positive number of seconds"):
        Settings.from_env({STORE_OUTAGE_ENV: raw})
