"""World sizes of a scaling run: parsing and the fit to the cluster, before any training."""

from __future__ import annotations

import pytest

import flows.scaling
from ddpflow.workloads.scaling import ScalingConfigError, parse_world_sizes, plan_world_sizes
from flows.params import (
    CharLMScalingParams,
    ImageScalingParams,
    ParameterError,
    validate_params,
)
from flows.scaling import plan_sizes


def test_a_comma_list_is_sorted_without_repeats() -> None:
    assert parse_world_sizes("4, 1,2,2") == [1, 2, 4]
    assert parse_world_sizes(None) is None and parse_world_sizes("  ") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "world_sizes='0': 0 is not a positive world size"),
        ("1,-2", "world_sizes='1,-2': -2 is not a positive world size"),
        ("1,two", "world_sizes='1,two': 'two' is not an integer"),
        ("1,,2", "world_sizes='1,,2': '' is not an integer"),
    ],
)
def test_bad_sizes_name_the_input_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ScalingConfigError) as caught:
        parse_world_sizes(text)
    assert str(caught.value).startswith(message)
    assert "pass positive integers separated by commas" in str(caught.value)


def test_the_default_is_every_size_up_to_the_cluster() -> None:
    assert plan_world_sizes(None, 3) == [1, 2, 3]
    assert plan_world_sizes([1, 2], 2) == [1, 2]


def test_a_size_larger_than_the_cluster_is_refused_with_the_fix() -> None:
    with pytest.raises(ScalingConfigError, match=r"world_sizes=1,3,4: 3,4 larger than the cl"):
        plan_world_sizes([1, 3, 4], 2)
    with pytest.raises(ScalingConfigError, match="DDPFLOW_DASK_WORKERS"):
        plan_world_sizes(None, 0)


def test_the_flow_checks_the_syntax_before_asking_the_cluster(monkeypatch) -> None:
    def no_cluster() -> list[str]:
        raise AssertionError("the cluster was asked before the syntax was checked")

    monkeypatch.setattr(flows.scaling, "rank_workers", no_cluster)
    with pytest.raises(ParameterError, match="world_sizes='0'"):
        plan_sizes("0")


def test_the_flow_fits_the_sizes_to_the_rank_workers(monkeypatch) -> None:
    monkeypatch.setattr(flows.scaling, "rank_workers", lambda: ["tcp://a:1", "tcp://b:1"])
    assert plan_sizes(None) == [1, 2]
    with pytest.raises(ParameterError, match=r"3 larger than the cluster's 2 worker\(s\)"):
        plan_sizes("3")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"target_loss": 0.0}, "target_loss=0.0: Input should be greater than 0$"),
        ({"target_accuracy": 1.5}, "target_accuracy=1.5: Input should be less than or equal to 1$"),
    ],
)
def test_bad_targets_name_the_field_and_the_fix(values: dict, message: str) -> None:
    with pytest.raises(ParameterError, match=message):
        validate_params(
            ImageScalingParams if "target_accuracy" in values else CharLMScalingParams, values
        )


@pytest.mark.parametrize(
    ("model", "values", "message"),
    [
        (CharLMScalingParams, {"epochs": 0}, "epochs=0: Input should be greater than or equal"),
        (CharLMScalingParams, {"lr": -1.0}, "lr=-1.0: Input should be greater than 0$"),
        (ImageScalingParams, {"image_size": 4}, "image_size=4: Input should be greater than or"),
        (CharLMScalingParams, {"target_loss": -1.0}, "target_loss=-1.0: Input should be great"),
    ],
)
def test_the_scaling_flows_check_the_training_parameters_first(model, values, message) -> None:
    # The training's own rules, in the scaling flow's parameter model: Prefect checks it
    # before the flow's body runs, so before the cluster, the store or MLflow is touched.
    with pytest.raises(ParameterError, match=message):
        validate_params(model, values)
