"""The task runner names the Dask dashboard only where one answers: prefect-dask logs
Dask's link (the scheduler's HTTP port, 8787 by default) even for a scheduler that serves
no dashboard there. In-process schedulers on 127.0.0.1, no workers."""

from __future__ import annotations

import logging

import distributed
import pytest

from ddpflow.cluster.build import LOOPBACK_DASHBOARD
from ddpflow.integrations.prefect.task_runner import DASHBOARD_LINE, PlacingDaskTaskRunner

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("dashboard", [False, True])
def test_the_dashboard_line_only_for_a_dashboard_that_answers(dashboard, caplog):
    # Either way its HTTP server takes a free port on loopback: without an address it would
    # take 8787, which the compose stack's dashboard publishes while other modules run.
    with distributed.LocalCluster(
        n_workers=0,
        processes=False,
        protocol="tcp",
        host="127.0.0.1",
        scheduler_kwargs={"dashboard": dashboard, "dashboard_address": LOOPBACK_DASHBOARD},
    ) as cluster:
        caplog.set_level(logging.INFO)
        runner = PlacingDaskTaskRunner(address=cluster.scheduler_address)
        with runner:
            assert runner.client.status == "running"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(DASHBOARD_LINE)]
    assert len(lines) == (1 if dashboard else 0), lines
