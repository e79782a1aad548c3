"""Adopting the LocalCluster a flow's command line started beside its embedded API
(ddpflow/integrations/prefect/early_cluster.py). The cluster here is a stand-in object: these
tests check
which cluster the flow gets and what is closed, not Dask (the integration test
`test_train_charlm_flow.py::test_the_flow_runs_on_the_cluster_started_beside_its_embedded_api`
runs the real one)."""

from __future__ import annotations

import concurrent.futures

import pytest

from ddpflow.integrations.prefect import early_cluster

URL = "http://127.0.0.1:4242/api"


class _Cluster:
    def __init__(self) -> None:
        self.closed = False

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


def _started(cluster: object, workers: int = 2, url: str = URL, tls: bool = True) -> None:
    future: concurrent.futures.Future = concurrent.futures.Future()
    if isinstance(cluster, BaseException):
        future.set_exception(cluster)
    else:
        future.set_result(cluster)
    early_cluster._pending = (workers, url, tls, future)


@pytest.fixture(autouse=True)
def _nothing_pending():
    early_cluster._pending = None
    yield
    early_cluster._pending = None


def test_the_cluster_the_flow_asks_for_is_adopted_once():
    cluster = _Cluster()
    _started(cluster)
    assert early_cluster.adopt(2, URL, {}) is cluster
    assert not cluster.closed
    assert early_cluster.adopt(2, URL, {}) is None, "handed over once: the runner owns it"


@pytest.mark.parametrize(
    ("workers", "url", "options", "tls"),
    [
        (3, URL, {}, True),
        (2, "http://127.0.0.1:9999/api", {}, True),
        (2, URL, {"resources": {"GPU": 1}}, True),
        (2, URL, {}, False),
    ],
    ids=["other_worker_count", "other_api", "other_options", "tls_turned_off"],
)
def test_another_cluster_asked_for_closes_the_early_one(workers, url, options, tls):
    cluster = _Cluster()
    _started(cluster)
    assert early_cluster.adopt(workers, url, options, tls) is None
    assert cluster.closed


def test_a_failed_early_start_leaves_the_flow_to_start_its_own():
    _started(OSError("no free port"))
    assert early_cluster.adopt(2, URL, {}) is None


def test_an_unadopted_cluster_is_closed_at_exit():
    cluster = _Cluster()
    _started(cluster)
    early_cluster._close_unadopted()
    assert cluster.closed and early_cluster._pending is None


@pytest.mark.parametrize(
    "env",
    [
        {"DDPFLOW_DASK_ADDRESS": "tcp://127.0.0.1:8786"},
        {"DDPFLOW_CLUSTER_OPTIONS": '{"n_workers": 4}'},
        {"DDPFLOW_DASK_WORKERS": "zero"},
    ],
    ids=["existing_cluster", "cluster_options", "bad_setting"],
)
def test_only_the_default_local_cluster_starts_early(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    early_cluster.start_early(URL)
    assert early_cluster._pending is None


def test_the_early_start_follows_the_tls_setting(monkeypatch):
    """The early cluster is started with DDPFLOW_LOCAL_CLUSTER_TLS as the flow would read
    it; `_start` is replaced so that no cluster starts in a unit test."""
    started: list[tuple] = []
    monkeypatch.setattr(early_cluster, "_start", lambda *args: started.append(args))
    monkeypatch.setattr(early_cluster.atexit, "register", lambda fn: None)
    for value, tls in (("", True), ("0", False)):
        monkeypatch.setenv("DDPFLOW_LOCAL_CLUSTER_TLS", value)
        early_cluster.start_early(URL)
        pending = early_cluster._pending
        assert pending is not None and pending[:3] == (2, URL, tls)
        pending[3].result(timeout=10)
        early_cluster._pending = None
    assert started == [(2, URL, True), (2, URL, False)]
