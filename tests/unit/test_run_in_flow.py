"""ddpflow.run_in_flow()'s checks that need no flow run: misuse fails at once, naming the fix."""

from __future__ import annotations

import pytest

import ddpflow


def train(ctx: ddpflow.TrainContext) -> None:
    pass


def test_outside_a_flow_it_names_ddpflow_run():
    # docs/api.md "In a Prefect flow": outside a flow, use ddpflow.run with a client.
    with pytest.raises(RuntimeError, match=r"inside a Prefect flow.*ddpflow\.run\(client"):
        ddpflow.run_in_flow(train)


def test_it_takes_no_client():
    with pytest.raises(TypeError, match="uses the flow's Dask client"):
        ddpflow.run_in_flow(train, client=object())
