"""DDPFLOW_LOCAL_CLUSTER_TLS and the TLS arguments of the clusters ddpflow starts on this
machine: no process starts here (the integration test
tests/integration/test_local_cluster_tls.py starts the real cluster and attacks it as
another OS user)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest
from distributed.security import Security

from ddpflow.cluster import build
from ddpflow.cluster.local_tls import local_security
from ddpflow.config import LOCAL_TLS_ENV, ConfigError, Settings
from ddpflow.integrations.prefect import task_runner as runner


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, True), ("", True), ("1", True), ("on", True), ("0", False), (" Off ", False)],
)
def test_tls_is_on_unless_turned_off(tmp_path: Path, raw: str | None, expected: bool) -> None:
    env = {} if raw is None else {LOCAL_TLS_ENV: raw}
    settings = Settings.from_env(env, project_dir=tmp_path)
    assert settings.local_cluster_tls is expected
    assert runner.dask_task_runner(settings).cluster_kwargs["tls"] is expected


def test_a_bad_switch_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{LOCAL_TLS_ENV}='maybe' is not on or off"):
        Settings.from_env({LOCAL_TLS_ENV: "maybe"}, project_dir=tmp_path)


def test_on_gives_fresh_mutual_tls_credentials_per_cluster() -> None:
    first, second = local_security(True, {})["security"], local_security(True, {})["security"]
    assert isinstance(first, Security) and first.require_encryption
    for role in ("scheduler", "worker", "client"):  # every role shows a certificate
        assert getattr(first, f"tls_{role}_cert") and getattr(first, f"tls_{role}_key")
    assert first.tls_ca_file != second.tls_ca_file, "each cluster has its own CA"
    assert local_security(True, {"protocol": "tls://"})["security"].require_encryption
    assert local_security(False, {}) == {}


@pytest.mark.parametrize(
    "options", [{"protocol": "tcp"}, {"protocol": "tcp://"}, {"security": True}]
)
def test_options_that_contradict_tls_are_refused_naming_the_switch(options: dict) -> None:
    with pytest.raises(ConfigError, match=f"DDPFLOW_CLUSTER_OPTIONS sets .*{LOCAL_TLS_ENV}=0"):
        local_security(True, options)
    assert local_security(False, options) == {}


@pytest.fixture
def dask_config() -> Iterator[None]:
    saved = copy.deepcopy(dask.config.config)  # cuda_cluster sets ddpflow's config globally
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


@pytest.mark.parametrize("tls", [True, False])
def test_the_cuda_kind_gets_the_same_tls(monkeypatch, dask_config, tls: bool) -> None:
    """No GPU here: torch's CUDA check and LocalCUDACluster (which passes its keyword
    arguments on to LocalCluster) are replaced by stand-ins that record the call."""
    import dask_cuda

    calls: list[dict] = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(dask_cuda, "LocalCUDACluster", lambda **kwargs: calls.append(kwargs))
    build.build_cluster("cuda", {"n_workers": 1}, tls=tls)
    (kwargs,) = calls
    assert isinstance(kwargs.get("security"), Security) is tls
