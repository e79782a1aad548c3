"""The promotion lock against a real MLflow registry (SQLite), threads standing for hosts.

Interleavings that real timing would hit only rarely are replayed by pausing one thread
inside a chosen client call (tests/unit/registry_hooks.py); everything else is the real
store. Timings are small (ttl 1 s) so each test takes a few seconds.
"""

from __future__ import annotations

import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.registry.promotion_lock import (
    BEAT_TAG,
    HOLDER_TAG,
    LockTiming,
    PromotionLockLost,
    PromotionLockTimeout,
    end_name,
    generation_name,
    lock_name,
    promotion_lock,
    read_state,
)
from tests.unit.legacy_promotion_lock import legacy_promotion_lock
from tests.unit.registry_hooks import hook_client

# A registry write takes 20-200 ms on a loaded machine: the lease leaves room for that.
FAST = LockTiming(ttl_s=1.0, max_call_s=0.3, wait_s=20.0, poll_s=0.02)
# For a holder that must keep its lease while it sleeps past it: its heartbeat thread was
# once starved for 1.4 s at the end of a full suite on 2 cores, which broke FAST's 1 s lease.
STEADY = LockTiming(ttl_s=3.0, max_call_s=0.3, wait_s=20.0, poll_s=0.02)


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    uri = f"sqlite:///{tmp_path_factory.mktemp('lock-registry') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # creates the schema once (several seconds)
    return uri


def leave_dead_holder(client: MlflowClient, name: str, generation: int = 1, **tags: str) -> None:
    """What a holder that died leaves: its generation, no end, a heartbeat that never moves."""
    client.create_registered_model(generation_name(name, generation), tags=tags)


def run_thread(name: str, target) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def test_the_old_check_then_delete_lock_let_two_promotions_hold_it(uri, monkeypatch):
    """The audit's interleaving, on the old lock: B reads the expired holder's token, C breaks
    that lock and takes it, then B deletes C's lock and takes it too."""
    client, name = MlflowClient(uri), "legacy-model"
    client.create_registered_model(  # what a holder that died left, long expired
        f"{name}.promotion-lock",
        tags={"ddpflow.lock.token": "dead", "ddpflow.lock.expires_at": "0"},
    )
    b_checked, c_holds, b_entered = threading.Event(), threading.Event(), threading.Event()

    def pause_b_before_its_delete(method: str, args: tuple[object, ...]) -> None:
        if threading.current_thread().name == "B" and not c_holds.is_set():
            b_checked.set()
            c_holds.wait(10)

    hook_client(monkeypatch, ("delete_registered_model",), pause_b_before_its_delete)

    def promoter_b() -> None:
        with legacy_promotion_lock(client, name, ttl_s=60):
            b_entered.set()

    b = run_thread("B", promoter_b)
    assert b_checked.wait(10)
    with legacy_promotion_lock(client, name, ttl_s=60):  # C
        c_holds.set()
        both_held = b_entered.wait(5)
    b.join(10)
    assert both_held, "the old lock was expected to let B in while C held it"


def test_the_same_interleaving_cannot_let_two_promotions_hold_the_lock(uri, monkeypatch):
    """B is paused right before it breaks the dead holder's generation; C breaks it and
    takes the next one. B's break is then refused (the end of generation 1 exists), and B
    waits for C: never both inside."""
    client, name = MlflowClient(uri), "two-breakers"
    leave_dead_holder(client, name)
    b_about_to_break, c_holds = threading.Event(), threading.Event()
    inside: list[tuple[int, float]] = []

    def pause_b_before_its_break(method: str, args: tuple[object, ...]) -> None:
        breaking = str(args[0]) == end_name(name, 1)
        if threading.current_thread().name == "B" and breaking and not c_holds.is_set():
            b_about_to_break.set()
            c_holds.wait(10)

    hook_client(monkeypatch, ("create_registered_model",), pause_b_before_its_break)

    def promoter_b() -> None:
        with promotion_lock(client, name, STEADY) as held:
            inside.append((held.generation, time.monotonic()))

    b = run_thread("B", promoter_b)
    assert b_about_to_break.wait(10)
    with promotion_lock(client, name, STEADY) as held:  # C
        entered = time.monotonic()
        assert held.generation == 2
        c_holds.set()
        time.sleep(1.5 * STEADY.ttl_s)  # B would have broken C's lock by now, were it dead
        held.ensure_held()  # C's lease is intact: its heartbeat kept it
        left = time.monotonic()
    b.join(10)
    assert not b.is_alive()
    assert inside == [(3, inside[0][1])] and inside[0][1] > left > entered, inside


def test_many_waiters_breaking_one_dead_lock_take_it_one_at_a_time(uri):
    client, name = MlflowClient(uri), "many-breakers"
    leave_dead_holder(client, name, **{BEAT_TAG: "7"})
    spans: list[tuple[float, float, int]] = []
    start = threading.Barrier(4)

    def waiter() -> None:
        start.wait()
        with promotion_lock(MlflowClient(uri), name, FAST) as held:
            entered = time.monotonic()
            time.sleep(0.05)
            spans.append((entered, time.monotonic(), held.generation))

    threads = [run_thread(f"W{i}", waiter) for i in range(4)]
    for thread in threads:
        thread.join(30)
    spans.sort()
    assert len(spans) == 4
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert sorted(g for _, _, g in spans) == [2, 3, 4, 5]  # one generation each, none shared


def test_a_promoter_that_slept_past_a_cleanup_does_not_take_a_spent_generation(uri, monkeypatch):
    """`stale` saw generation 1 end and is paused right before creating generation 2. Others
    go on to generation 4, whose holder deletes generations 1 and 2. When `stale` wakes, its
    creation of generation 2 succeeds, but a higher generation exists: it holds nothing."""
    client, name = MlflowClient(uri), "stale-acquirer"
    about_to_create, go_on = threading.Event(), threading.Event()
    inside: list[tuple[int, float]] = []

    def pause_stale_before_generation_2(method: str, args: tuple[object, ...]) -> None:
        if threading.current_thread().name == "stale" and args[0] == generation_name(name, 2):
            about_to_create.set()
            go_on.wait(10)

    hook_client(monkeypatch, ("create_registered_model",), pause_stale_before_generation_2)

    def stale() -> None:
        with promotion_lock(client, name, FAST) as held:
            inside.append((held.generation, time.monotonic()))

    with promotion_lock(client, name, FAST):
        thread = run_thread("stale", stale)
        time.sleep(0.2)  # stale is waiting for generation 1
    assert about_to_create.wait(10)
    for _ in range(2):
        with promotion_lock(client, name, FAST):
            pass
    with promotion_lock(client, name, FAST) as held:
        assert held.generation == 4
        names = {m.name for m in client.search_registered_models(f"name LIKE '{name}%'")}
        assert generation_name(name, 2) not in names, "generation 2 was cleaned up"
        go_on.set()
        time.sleep(1.5 * FAST.ttl_s)
        left = time.monotonic()
    thread.join(10)
    assert len(inside) == 1 and inside[0][0] == 5 and inside[0][1] > left, inside


@pytest.mark.parametrize(
    "tags",
    [{}, {BEAT_TAG: "not a number 🙃", HOLDER_TAG: ""}, {BEAT_TAG: "-1e999"}],
    ids=["no-tags", "garbled", "absurd"],
)
def test_garbled_or_missing_lock_tags_neither_crash_nor_block_forever(uri, tags):
    client = MlflowClient(uri)
    name = f"garbled-{len(tags)}"
    # The old lock's model with the field that crashed it, names that are not generations,
    # and a "dead holder" whose tags are missing or garbage.
    client.create_registered_model(lock_name(name), tags={"ddpflow.lock.expires_at": "soon"})
    for junk in ("x", "007", "0", "-3", "2.end.end"):
        client.create_registered_model(f"{lock_name(name)}.{junk}")
    client.create_registered_model(generation_name(name, 2), tags=tags)
    started = time.monotonic()
    with promotion_lock(client, name, FAST) as held:
        waited = time.monotonic() - started
    assert held.generation == 3
    assert FAST.ttl_s <= waited < FAST.ttl_s + 5
    assert read_state(client, name).free


def test_a_held_lock_makes_the_next_promoter_wait_then_give_up_naming_it(uri):
    client = MlflowClient(uri)
    patient = LockTiming(ttl_s=1.0, max_call_s=0.3, wait_s=1.5, poll_s=0.05)
    with (
        promotion_lock(client, "locked-model", FAST),
        pytest.raises(PromotionLockTimeout, match=r"locked-model\.promotion-lock\.1") as error,
        promotion_lock(client, "locked-model", patient),
    ):
        pass
    assert "locked-model.promotion-lock.1.end" in str(error.value)  # how to break it by hand
    with promotion_lock(client, "locked-model", patient) as held:  # released: free again
        assert held.generation == 2


def test_a_broken_or_silent_lock_is_no_longer_held(uri, monkeypatch):
    """ensure_held, called right before the alias is set, refuses once the end exists, and
    once the holder's own heartbeats have stopped landing for ttl - max_call."""
    client = MlflowClient(uri)
    with promotion_lock(client, "broken-model", FAST) as held:
        held.ensure_held()
        client.create_registered_model(end_name("broken-model", held.generation))
        with pytest.raises(PromotionLockLost, match="broken by another promoter"):
            held.ensure_held()

    def stall_heartbeats(method: str, args: tuple[object, ...]) -> None:
        if threading.current_thread().name.endswith("-promotion-lock-heartbeat"):
            time.sleep(2 * FAST.ttl_s)

    hook_client(monkeypatch, ("set_registered_model_tag",), stall_heartbeats)
    with promotion_lock(client, "silent-model", FAST) as held:
        time.sleep(FAST.ttl_s - FAST.max_call_s)
        with pytest.raises(PromotionLockLost, match="may be broken before one more"):
            held.ensure_held()


def test_a_lease_shorter_than_two_calls_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="ttl_s=100 must be at least twice max_call_s=60"):
        LockTiming(ttl_s=100, max_call_s=60, wait_s=10)
    with pytest.raises(ValueError, match=r"poll_s=nan"):
        LockTiming(ttl_s=1, max_call_s=0.1, wait_s=1, poll_s=float("nan"))


def test_a_lease_that_lapsed_once_stays_lost_when_heartbeats_resume(uri, monkeypatch):
    """A waiter may have decided to break on the beat before a long gap, and its `.end` may
    land after the holder's own check: after such a gap, fresh heartbeats prove nothing."""
    client = MlflowClient(uri)
    stalled: list[float] = []

    def stall_the_first_heartbeat(method: str, args: tuple[object, ...]) -> None:
        if threading.current_thread().name.endswith("-promotion-lock-heartbeat") and not stalled:
            stalled.append(time.monotonic())
            time.sleep(FAST.ttl_s)

    hook_client(monkeypatch, ("set_registered_model_tag",), stall_the_first_heartbeat)
    with promotion_lock(client, "lapsed-model", FAST) as held:
        time.sleep(FAST.ttl_s)  # the gap
        deadline = time.monotonic() + 10
        while time.monotonic() - held._confirmed > FAST.max_call_s:  # until beats land again
            assert time.monotonic() < deadline, "the heartbeat never resumed"
            time.sleep(0.02)
        with pytest.raises(PromotionLockLost, match="may be broken before one more"):
            held.ensure_held()
