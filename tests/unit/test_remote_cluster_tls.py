"""DDPFLOW_REMOTE_CLUSTER_TLS and what it does to the clusters a flow starts elsewhere: the
jobqueue cluster's per-run credentials (folder, files, options), the refusal of a per-run
KubeCluster, and pre-flight's warning about a plain tcp:// scheduler. Nothing starts here:
the real jobqueue cluster is in tests/integration/test_job_scripts.py and test_slurm.py."""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed.security import Security

from ddpflow.cluster.build import build_cluster
from ddpflow.cluster.jobqueue_tls import FOLDER_PREFIX, jobqueue_security
from ddpflow.config import CLUSTER_ENV, REMOTE_TLS_ENV, ConfigError, Settings
from ddpflow.integrations.prefect import task_runner as runner
from ddpflow.preflight import plain_scheduler
from ddpflow.preflight.plain_scheduler import warn_if_plain_tcp


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("1", True), ("0", False)])
@pytest.mark.parametrize("kind", ["jobqueue", "kubernetes"])
def test_the_remote_kinds_follow_their_own_switch(
    tmp_path: Path, kind: str, raw: str | None, expected: bool
) -> None:
    env = {CLUSTER_ENV: kind, "DDPFLOW_LOCAL_CLUSTER_TLS": "1"}
    settings = Settings.from_env(env | ({REMOTE_TLS_ENV: raw} if raw else {}), tmp_path)
    assert settings.remote_cluster_tls is expected
    assert runner.dask_task_runner(settings).cluster_kwargs["tls"] is expected


def test_the_cuda_kind_keeps_the_local_switch(tmp_path: Path) -> None:
    env = {CLUSTER_ENV: "cuda", REMOTE_TLS_ENV: "0"}
    assert runner.dask_task_runner(Settings.from_env(env, tmp_path)).cluster_kwargs["tls"]


def test_a_bad_remote_switch_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{REMOTE_TLS_ENV}='maybe' is not on or off"):
        Settings.from_env({REMOTE_TLS_ENV: "maybe"}, project_dir=tmp_path)


def _folder(tmp_path: Path) -> Path:
    (folder,) = tmp_path.glob(f"{FOLDER_PREFIX}*")
    return folder


def test_jobqueue_credentials_are_files_only_their_user_reads(tmp_path: Path) -> None:
    options: dict[str, Any] = {"shared_temp_directory": str(tmp_path), "security": True}
    made = jobqueue_security(True, options, "slurm")
    folder = _folder(tmp_path)
    assert made is not None and made.path == folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()} == {
        "ca.pem": 0o600,
        "cert.pem": 0o600,
        "key.pem": 0o600,
    }
    assert "PRIVATE KEY" in (folder / "key.pem").read_text()
    security = options["security"]
    assert isinstance(security, Security) and security.require_encryption
    assert options["protocol"] == "tls://"
    # Every role reads the same files; what reaches a job script is their paths, never PEM
    # text (dask-jobqueue would dump text into files of its own).
    for role in ("worker", "scheduler", "client"):
        config = security.get_tls_config_for_role(role)
        assert {config["ca_file"], config["cert"], config["key"]} == {
            str(folder / name) for name in ("ca.pem", "cert.pem", "key.pem")
        }
    made.remove()
    assert not folder.exists()


def test_each_jobqueue_cluster_gets_its_own_certificate(tmp_path: Path) -> None:
    keys = []
    for _ in range(2):
        options = {"shared_temp_directory": str(tmp_path)}
        made = jobqueue_security(True, options, "pbs")
        assert made is not None
        keys.append((made.path / "key.pem").read_text())
    assert keys[0] != keys[1]
    assert len(list(tmp_path.glob(f"{FOLDER_PREFIX}*"))) == 2


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"security": False}, "security=False"),
        ({"security": None}, "security=None"),
        ({"protocol": "tcp://"}, "protocol='tcp://'"),
        ({"scheduler_options": {"protocol": "tcp"}}, "scheduler_options.protocol='tcp'"),
        ({"scheduler_options": {"security": True}}, "scheduler_options.security=True"),
    ],
)
def test_options_that_contradict_jobqueue_tls_are_refused_naming_the_switch(
    tmp_path: Path, options: dict, named: str
) -> None:
    options = {**options, "shared_temp_directory": str(tmp_path)}
    with pytest.raises(ConfigError, match=f"sets {named}, .*{REMOTE_TLS_ENV}=0"):
        jobqueue_security(True, options, "slurm")
    assert not list(tmp_path.iterdir()), "refused before any credential was written"
    unchanged = dict(options)
    assert jobqueue_security(False, options, "slurm") is None
    assert options == unchanged, "with TLS off the options are the user's own"


def test_the_credentials_go_to_the_home_folder_unless_a_shared_one_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, configured = tmp_path / "home", tmp_path / "configured"
    home.mkdir()
    configured.mkdir()
    monkeypatch.setenv("HOME", str(home))
    jobqueue_security(True, {}, "slurm")
    assert _folder(home)
    with dask.config.set({"jobqueue.slurm.shared-temp-directory": str(configured)}):
        jobqueue_security(True, {}, "slurm")
    assert _folder(configured)
    # `$VAR` and `~` as in dask-jobqueue's own option (the shipped examples say "$HOME").
    monkeypatch.setenv("SHARED", str(configured))
    (configured / "sub").mkdir()
    jobqueue_security(True, {"shared_temp_directory": "$SHARED/sub"}, "slurm")
    assert _folder(configured / "sub")


def test_a_shared_folder_that_is_missing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shared_temp_directory='.*nowhere' is not a folder"):
        jobqueue_security(True, {"shared_temp_directory": str(tmp_path / "nowhere")}, "slurm")


def test_a_failed_jobqueue_start_leaves_no_credentials(tmp_path: Path) -> None:
    """dask-jobqueue refuses an unknown option before its cluster starts anything."""
    with pytest.raises(ValueError, match="unexpected keyword argument 'bogus'"):
        build_cluster("jobqueue", {"shared_temp_directory": str(tmp_path), "bogus": 1})
    assert not list(tmp_path.iterdir())


# --- the per-run KubeCluster ------------------------------------------------------------------


class KubeClusterStandIn:
    """Records what KubeCluster would have been given (no Kubernetes here)."""

    calls: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)


@pytest.fixture
def kube_cluster(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import dask_kubernetes.operator

    KubeClusterStandIn.calls = []
    monkeypatch.setattr(dask_kubernetes.operator, "KubeCluster", KubeClusterStandIn)
    return KubeClusterStandIn.calls


def test_a_per_run_kubecluster_is_refused_naming_the_tls_way(kube_cluster: list) -> None:
    with pytest.raises(ConfigError) as refused:
        build_cluster("kubernetes", {"n_workers": 2, "namespace": "ml"})
    message = str(refused.value)
    assert "plain tcp://" in message and "DaskCluster with tls_secret" in message
    assert "DDPFLOW_DASK_ADDRESS=tls://NAME-scheduler:8786" in message
    assert f"{REMOTE_TLS_ENV}=0" in message
    assert kube_cluster == [], "refused before anything was created"


def test_a_per_run_kubecluster_starts_when_opted_out_with_a_warning(
    kube_cluster: list, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpflow.cluster.tls"):
        build_cluster("kubernetes", {"n_workers": 2, "namespace": "ml"}, tls=False)
    (call,) = kube_cluster
    assert call["namespace"] == "ml" and call["custom_cluster_spec"]["kind"] == "DaskCluster"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{REMOTE_TLS_ENV}=0" in warning.getMessage()
    assert "plain tcp://" in warning.getMessage()


def test_tls_secret_on_a_per_run_kubecluster_keeps_its_own_message(kube_cluster: list) -> None:
    for tls in (True, False):
        with pytest.raises(ConfigError, match="cannot use tls_secret"):
            build_cluster("kubernetes", {"tls_secret": "s"}, tls=tls)
    assert kube_cluster == []


# --- pre-flight on an existing plain tcp:// scheduler ----------------------------------------


def test_preflight_warns_once_per_plain_tcp_scheduler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plain_scheduler, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=plain_scheduler.__name__):
        assert warn_if_plain_tcp("tcp://10.0.0.1:8786")
        assert not warn_if_plain_tcp("tcp://10.0.0.1:8786"), "once per scheduler"
        assert not warn_if_plain_tcp("tls://10.0.0.1:8786")
        assert warn_if_plain_tcp("tcp://10.0.0.2:8786")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "tcp://10.0.0.1:8786" in messages[0] and "runs code" in messages[0]
