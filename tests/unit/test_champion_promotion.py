"""Promotion against a real MLflow registry (SQLite): first model, races, NaN, aborts.

The flows' lock, a Prefect concurrency limit on a real server, and promoters frozen past
its lease: tests/integration/test_promotion_limit.py; without a server:
tests/unit/test_promotion_lock.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.registry.promotion_lock import HeldLock, PromotionLockLost
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.charlm.champion import CHAMPION_ALIAS, Decision, promote
from ddpflow.workloads.charlm.evaluation import register_model
from tests.helpers.champion_helpers import (
    add_version,
    constant_model,
    peaked_bias,
    start_checkpointed_run,
    unigram_bias,
    write_holdout,
)
from tests.helpers.registry_hooks import hook_client


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> tuple[str, str, Path]:
    """(tracking URI, holdout URI, scratch folder) shared by this module's tests."""
    folder = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # creates the schema once (several seconds)
    return uri, write_holdout(folder), folder


def alias_of(client: MlflowClient, name: str) -> str:
    return str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version)


def test_the_first_model_is_promoted_when_there_is_no_champion(registry):
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = "first-model"
    run_id = start_checkpointed_run(client, constant_model(unigram_bias(val_uri)), folder)
    checkpoint = client.get_run(run_id).data.tags["ddpflow.latest_checkpoint"]
    version = register_model(RunRef(uri, run_id), checkpoint, name)  # as the flows register

    decision = promote(uri, name, run_id, version, val_uri, margin=0.0)

    assert decision.promoted and decision.reason == "no champion yet"
    assert alias_of(client, name) == version
    assert client.get_run(run_id).data.tags["ddpflow.retrain.promoted"] == "True"


def test_two_concurrent_promotions_end_with_the_better_model(registry):
    """Both challengers beat the old champion; the worse one is much slower to score, so it
    decides last. Deciding against the champion it saw at the start would hand it the alias."""
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = "raced-model"
    old, _ = add_version(client, name, constant_model(peaked_bias()), folder)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, old)
    better = add_version(client, name, constant_model(unigram_bias(val_uri)), folder)
    slow_worse = add_version(
        client, name, constant_model(peaked_bias() * 0, hidden_size=256, num_layers=2), folder
    )
    start = threading.Barrier(2)
    decisions: dict[str, Decision | BaseException] = {}

    def promote_one(version: str, run_id: str) -> None:
        start.wait()
        try:
            decisions[version] = promote(uri, name, run_id, version, val_uri, margin=0.0)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            decisions[version] = error

    threads = [threading.Thread(target=promote_one, args=v) for v in (better, slow_worse)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(isinstance(d, Decision) for d in decisions.values()), decisions
    assert alias_of(client, name) == better[0]
    worse_decision = decisions[slow_worse[0]]
    if not worse_decision.promoted:  # it decided last: against the better model, not the old
        assert worse_decision.champion_version == better[0]


def test_a_nan_champion_loses_to_any_finite_challenger_and_the_decision_says_so(registry):
    """A champion whose checkpoint scores NaN (its weights are NaN) used to keep the alias
    for ever: every comparison with NaN is false."""
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = "nan-champion"
    broken, _ = add_version(client, name, constant_model(peaked_bias() * float("nan")), folder)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, broken)
    challenger, run_id = add_version(client, name, constant_model(peaked_bias()), folder)

    decision = promote(uri, name, run_id, challenger, val_uri, margin=0.5)

    assert decision.promoted and decision.champion_version == broken
    assert decision.reason.startswith("champion loss nan is not a finite number")
    assert alias_of(client, name) == challenger
    tags = client.get_run(run_id).data.tags
    assert tags["ddpflow.retrain.promoted"] == "True"
    assert tags["ddpflow.retrain.champion_loss"] == "nan"


def test_a_champion_moved_by_hand_while_deciding_aborts_and_the_decision_says_so(
    registry, monkeypatch
):
    """Someone moves the alias in the UI after the promoter read it under its lock: the
    re-read right before the write sees it, and nothing moves. The move is injected at the
    promoter's re-read (tests/helpers/registry_hooks.py); the registry is real."""
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = "moved-by-hand"
    old, _ = add_version(client, name, constant_model(peaked_bias()), folder)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, old)
    by_hand, _ = add_version(client, name, constant_model(peaked_bias() * 0.5), folder)
    challenger, run_id = add_version(client, name, constant_model(unigram_bias(val_uri)), folder)
    reads = []

    def move_by_hand_before_the_re_read(method: str, args: tuple[object, ...]) -> None:
        reads.append(args[0])
        if reads.count(name) == 3:  # before the lock, under it, then right before the write
            MlflowClient(uri).set_registered_model_alias(name, CHAMPION_ALIAS, by_hand)

    hook_client(monkeypatch, ("get_registered_model",), move_by_hand_before_the_re_read)
    decision = promote(uri, name, run_id, challenger, val_uri, margin=0.0)

    assert not decision.promoted and decision.champion_version == old
    assert decision.reason.startswith(f"promotion aborted: the champion changed from v{old} to ")
    assert f"v{by_hand}" in decision.reason
    assert alias_of(client, name) == by_hand
    assert client.get_run(run_id).data.tags["ddpflow.retrain.reason"] == decision.reason


class LeaseRanOut:
    """A held lock whose lease ran out while the promoter decided (it was frozen, or cut off
    from the Prefect server): what `Lease.ensure_held` then raises."""

    def ensure_held(self) -> None:
        raise PromotionLockLost("the promotion limit 'x' lost its lease")


@contextmanager
def lost_lock(tracking_uri: str, model_name: str) -> Iterator[HeldLock]:
    yield LeaseRanOut()


def test_a_promotion_whose_lease_ran_out_aborts_and_records_why(registry):
    """Its decision stands, but another promotion may hold the lock by now: nothing moves,
    and the run says so; the champion's version, which the lock's holder may be writing
    its own decision on, gets none of this one's tags."""
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = "lost-lease"
    old, _ = add_version(client, name, constant_model(peaked_bias()), folder)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, old)
    challenger, run_id = add_version(client, name, constant_model(unigram_bias(val_uri)), folder)

    decision = promote(uri, name, run_id, challenger, val_uri, margin=0.0, lock=lost_lock)

    assert not decision.promoted
    assert decision.reason.startswith("promotion aborted: the promotion limit 'x' lost its lease")
    assert alias_of(client, name) == old
    tags = client.get_run(run_id).data.tags
    assert (tags["ddpflow.retrain.promoted"], tags["ddpflow.retrain.reason"]) == (
        "False",
        decision.reason,
    )
    assert not any(
        k.startswith("ddpflow.retrain") for k in client.get_model_version(name, old).tags
    )
