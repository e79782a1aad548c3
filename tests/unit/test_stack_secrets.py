"""The stack's credentials and Dask certificates: private files, usable certificates."""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

import pytest

from infra import certs
from infra.auth import MLFLOW_AUTH_CACHE_TTL_S, StackSecrets
from infra.private import write_private


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_existing_readable_file_is_replaced_by_a_private_one(tmp_path: Path) -> None:
    target = tmp_path / "env.sh"
    target.write_text("old")
    target.chmod(0o644)
    write_private(target, "export SECRET=x\n")
    assert target.read_text() == "export SECRET=x\n"
    assert mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["env.sh"], "no temporary file left"


def test_private_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = write_private(tmp_path / "key.pem", b"secret")
    finally:
        os.umask(old)
    assert mode(path) == 0o600


def test_certs_command_writes_a_ca_and_a_certificate_it_signed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tls"
    assert certs.main([str(folder)]) == 0
    files = certs.TlsFiles.in_dir(folder)
    assert mode(folder) == 0o700
    assert [mode(p) for p in (files.ca, files.cert, files.key)] == [0o600] * 3
    # The certificate verifies against the CA and its key, as Dask's TLS contexts load them.
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(files.ca))
    server.load_cert_chain(files.cert, files.key)
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    client.check_hostname = False
    client.load_cert_chain(files.cert, files.key)
    assert "DASK_DISTRIBUTED__COMM__TLS__CA_FILE" in capsys.readouterr().out


def test_certs_command_rejects_a_nonpositive_validity(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        certs.main([str(tmp_path / "tls"), "--days", "0"])
    assert not (tmp_path / "tls").exists(), "nothing written for bad input"


def test_stack_secrets_are_fresh_private_and_reach_the_clients(tmp_path: Path) -> None:
    first = StackSecrets.create(tmp_path / "secrets")
    second = StackSecrets.create(tmp_path / "secrets")
    assert first.prefect_auth_string != second.prefect_auth_string
    assert first.mlflow_password != second.mlflow_password
    files = [p for p in (tmp_path / "secrets").rglob("*") if p.is_file()]
    assert len(files) == 4 and all(mode(p) == 0o600 for p in files), files
    env = second.client_env()
    assert env["PREFECT_API_AUTH_STRING"] == second.prefect_auth_string
    assert env["MLFLOW_TRACKING_PASSWORD"] == second.mlflow_password
    assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
    assert Path(env["DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY"]) == second.tls.key
    ini = second.mlflow_auth_config.read_text()
    assert second.mlflow_password in ini and str(tmp_path / "secrets") in ini


def test_mlflow_reads_a_cached_password_check_from_both_auth_configs(tmp_path, monkeypatch):
    """The stack's and compose's MLflow auth configs turn on MLflow's credential cache, as
    MLflow itself reads them: without it every request pays a scrypt check (0.13-0.21
    CPU-seconds here; python -m bench.mlflow_auth)."""
    from mlflow.server.auth.config import read_auth_config

    stack = StackSecrets.create(tmp_path / "secrets").mlflow_auth_config
    compose = Path(__file__).resolve().parents[2] / "infra" / "docker" / "mlflow-auth.ini"
    for config in (stack, compose):
        monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(config))
        monkeypatch.setenv("MLFLOW_AUTH_ADMIN_PASSWORD", "unused-here")
        assert read_auth_config().auth_cache_ttl_seconds == MLFLOW_AUTH_CACHE_TTL_S, config
