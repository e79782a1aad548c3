"""A flow's Dask cluster that is slow to close never fails the finished flow."""

from __future__ import annotations

import logging

import distributed
import pytest

from ddpflow.cluster.build import LOOPBACK_DASHBOARD
from ddpflow.integrations.prefect.task_runner import PlacingDaskTaskRunner

pytestmark = pytest.mark.integration


class SlowToClose(distributed.LocalCluster):
    """Closes, then reports the timeout a loaded machine produces (workers that take longer
    to exit than the close waits). In-process workers: no processes needed to show it."""

    def close(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - LocalCluster's signature
        super().close(*args, **kwargs)
        raise TimeoutError("workers still alive after 4.0 seconds")


def test_a_close_that_times_out_is_logged_not_raised(caplog):
    runner = PlacingDaskTaskRunner(
        cluster_class=SlowToClose,
        cluster_kwargs={
            "n_workers": 1,
            "processes": False,
            "dashboard_address": LOOPBACK_DASHBOARD,
        },
    )
    caplog.set_level(logging.WARNING, logger="ddpflow.integrations.prefect.task_runner")
    with runner:
        assert runner.client.submit(sum, [1, 2]).result() == 3
    assert not runner._started, "the runner is stopped all the same"
    assert "did not close within its timeout" in caplog.text


def test_other_errors_on_close_still_raise():
    class Broken(distributed.LocalCluster):
        def close(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            super().close(*args, **kwargs)
            raise RuntimeError("scheduler state is corrupt")

    runner = PlacingDaskTaskRunner(
        cluster_class=Broken,
        cluster_kwargs={
            "n_workers": 1,
            "processes": False,
            "dashboard_address": LOOPBACK_DASHBOARD,
        },
    )
    with pytest.raises(RuntimeError, match="scheduler state is corrupt"), runner:
        runner.client.submit(sum, [1]).result()
