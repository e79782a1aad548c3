"""Where no Prefect server can hold a model's promotion limit: what a promotion does.

No server runs here (tests/unit starts none): each case is decided before any call to a
Prefect API, and would fail at once if it tried one. The limit itself, on a real server:
tests/integration/test_promotion_limit.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from ddpflow.integrations.prefect.early_api import EMBEDDED_API_ENV
from ddpflow.integrations.prefect.promotion_limit import (
    PromotionLockUnavailable,
    limit_name,
    promotion_lock,
    shared_api_url,
)

EMBEDDED = "http://127.0.0.1:41234/api"


@pytest.fixture
def no_prefect_server() -> Iterator[None]:
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        yield


@pytest.mark.parametrize(
    "registry",
    [
        "http://alice:s3cret@mlflow.example:5000",
        "postgresql://alice:s3cret@db/mlflow",
        "databricks",
    ],
)
def test_a_shared_registry_without_a_shared_prefect_server_refuses_naming_prefect_api_url(
    no_prefect_server, registry
):
    refusal = pytest.raises(PromotionLockUnavailable, match="set PREFECT_API_URL")
    with refusal as refused, promotion_lock(registry, "shared-model"):
        pytest.fail("promoted without a lock")
    assert "Nothing moved" in str(refused.value)
    assert "s3cret" not in str(refused.value)


def test_a_flows_embedded_api_counts_as_no_shared_server(monkeypatch):
    """A flow's command line without PREFECT_API_URL runs on an API of its own, which its
    worker processes get as PREFECT_API_URL: it serialises nothing beyond the flow."""
    monkeypatch.setenv(EMBEDDED_API_ENV, EMBEDDED)
    with temporary_settings({PREFECT_API_URL: EMBEDDED}):
        assert shared_api_url() is None
        refusal = pytest.raises(PromotionLockUnavailable, match="PREFECT_API_URL")
        with refusal, promotion_lock("https://mlflow.example", "shared-model"):
            pytest.fail("promoted without a lock")
    with temporary_settings({PREFECT_API_URL: "http://prefect.example:4200/api"}):
        assert shared_api_url() == "http://prefect.example:4200/api"


@pytest.mark.parametrize("registry", ["sqlite:///tmp/mlflow.db", "/tmp/mlruns", "file:///tmp/x"])
def test_a_local_registry_without_a_server_promotes_unlocked_and_says_so(
    no_prefect_server, registry, caplog
):
    with caplog.at_level(logging.INFO), promotion_lock(registry, "my-model") as held:
        held.ensure_held()  # nothing to lose: the re-read before the write is the guard
    assert "promoting 'my-model' without a lock: no shared Prefect server" in caplog.text


def test_every_model_name_makes_a_limit_name_prefect_accepts():
    assert limit_name("ddpflow-charlm") == "ddpflow-promote-ddpflow-charlm"
    # Prefect refuses / % & > < in names; ? # and spaces would break the limit's URL path.
    assert limit_name("team/a b?c%d") == "ddpflow-promote-team_a_b_c_d"
