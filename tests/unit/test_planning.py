"""Rank planning and backend choice are pure functions: no cluster needed."""

import pytest

from ddpflow.distributed.planning import (
    PlanError,
    RankAssignment,
    choose_backend,
    plan_ranks,
    worker_host,
)

WORKERS = {
    "tcp://10.0.0.7:40001": {"nthreads": 4},
    "tcp://10.0.0.5:40003": {"nthreads": 2},
    "tcp://10.0.0.6:40002": {"nthreads": 8},
}


def test_ranks_follow_address_order() -> None:
    plan = plan_ranks(WORKERS, world_size=3)
    assert [a.rank for a in plan] == [0, 1, 2]
    assert [a.worker_address for a in plan] == sorted(WORKERS)
    assert plan[0] == RankAssignment(0, "tcp://10.0.0.5:40003", "10.0.0.5", 2)


def test_plan_does_not_depend_on_dict_order() -> None:
    reversed_workers = dict(reversed(list(WORKERS.items())))
    assert plan_ranks(reversed_workers, 2) == plan_ranks(WORKERS, 2)


def test_world_size_none_uses_every_worker() -> None:
    plan = plan_ranks(WORKERS, world_size=None)
    assert len(plan) == 3
    assert {a.worker_address for a in plan} == set(WORKERS)


def test_smaller_world_size_takes_the_first_workers() -> None:
    plan = plan_ranks(WORKERS, world_size=2)
    assert [a.host for a in plan] == ["10.0.0.5", "10.0.0.6"]


def test_num_threads_come_from_worker_info() -> None:
    plan = plan_ranks(WORKERS, None)
    assert [a.num_threads for a in plan] == [2, 8, 4]


def test_num_threads_default_to_one() -> None:
    plan = plan_ranks({"tcp://127.0.0.1:1": {}}, None)
    assert plan[0].num_threads == 1


def test_too_many_ranks_explains_the_fix() -> None:
    with pytest.raises(PlanError) as info:
        plan_ranks(WORKERS, world_size=5)
    message = str(info.value)
    assert "world_size=5" in message
    assert "has 3" in message
    assert "DDPFLOW_DASK_WORKERS" in message
    assert "tcp://10.0.0.5:40003" in message


def test_no_workers_at_all() -> None:
    with pytest.raises(PlanError, match="has 0 \\(none\\)"):
        plan_ranks({}, world_size=1)


@pytest.mark.parametrize("world_size", [0, -2])
def test_non_positive_world_size_is_rejected(world_size: int) -> None:
    with pytest.raises(PlanError, match=f"world_size={world_size}"):
        plan_ranks(WORKERS, world_size=world_size)


def test_world_size_none_on_empty_cluster_is_rejected() -> None:
    with pytest.raises(PlanError, match="world_size=0"):
        plan_ranks({}, world_size=None)


def test_exclude_skips_workers() -> None:
    excluded = frozenset({"tcp://10.0.0.5:40003"})
    plan = plan_ranks(WORKERS, world_size=None, exclude=excluded)
    assert [a.worker_address for a in plan] == ["tcp://10.0.0.6:40002", "tcp://10.0.0.7:40001"]
    assert [a.rank for a in plan] == [0, 1]


def test_exclude_counts_against_capacity() -> None:
    excluded = frozenset({"tcp://10.0.0.5:40003"})
    with pytest.raises(PlanError, match="has 2"):
        plan_ranks(WORKERS, world_size=3, exclude=excluded)


def test_plan_error_is_a_value_error() -> None:
    assert issubclass(PlanError, ValueError)


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("tcp://10.0.0.5:40123", "10.0.0.5"),
        ("tcp://node-3.cluster:8786", "node-3.cluster"),
        ("tls://[::1]:9000", "::1"),
        ("inproc://127.0.0.1/123/1", "127.0.0.1"),
    ],
)
def test_worker_host(address: str, host: str) -> None:
    assert worker_host(address) == host


def test_worker_host_without_host_fails() -> None:
    with pytest.raises(PlanError, match="cannot read a host"):
        worker_host("not-an-address")


def test_backend_gloo_without_gpus() -> None:
    assert choose_backend({"tcp://a:1": False, "tcp://b:2": False}) == "gloo"


def test_backend_gloo_for_empty_group() -> None:
    assert choose_backend({}) == "gloo"


def test_backend_nccl_when_every_rank_has_a_gpu() -> None:
    assert choose_backend({"tcp://a:1": True, "tcp://b:2": True}) == "nccl"


def test_mixed_group_is_rejected_naming_the_workers() -> None:
    flags = {"tcp://gpu-b:1": True, "tcp://cpu:2": False, "tcp://gpu-a:3": True}
    with pytest.raises(PlanError) as info:
        choose_backend(flags)
    message = str(info.value)
    assert "['tcp://gpu-a:3', 'tcp://gpu-b:1'] have a GPU" in message
    assert "['tcp://cpu:2'] do not" in message
