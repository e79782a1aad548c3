"""The flows' command line raises Prefect's API client retries, so that a Prefect server
restart under a running flow does not fail it (integration/test_outages.py restarts one)."""

from __future__ import annotations

import os

from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

from flows.cli import CLIENT_MAX_RETRIES, CLIENT_RETRIES_ENV, prefect_client_retries


def test_flows_retry_the_prefect_api_for_minutes_by_default(monkeypatch):
    monkeypatch.delenv(CLIENT_RETRIES_ENV, raising=False)
    default = PREFECT_CLIENT_MAX_RETRIES.value()
    with prefect_client_retries():
        assert PREFECT_CLIENT_MAX_RETRIES.value() == CLIENT_MAX_RETRIES > default
        # The processes the flow starts (a LocalCluster's workers) inherit it.
        assert os.environ[CLIENT_RETRIES_ENV] == str(CLIENT_MAX_RETRIES)
    assert sum(2**n for n in range(CLIENT_MAX_RETRIES)) > 120, "pauses span minutes"


def test_a_retry_count_in_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv(CLIENT_RETRIES_ENV, "2")
    before = PREFECT_CLIENT_MAX_RETRIES.value()
    with prefect_client_retries():
        assert PREFECT_CLIENT_MAX_RETRIES.value() == before
        assert os.environ[CLIENT_RETRIES_ENV] == "2"
