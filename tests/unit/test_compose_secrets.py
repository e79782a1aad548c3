"""The compose stack's credentials: written fresh and private, placeholders refused.

`python -m infra.compose_secrets` (the quick start) and `python -m infra.compose_check` (the
check-secrets service every other service waits for), called in-process on real files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from infra import compose_check, compose_secrets
from infra.certs import make_certs
from infra.compose_check import VARIABLES, problems, read_env_file

DOCKER = Path(__file__).resolve().parents[2] / "infra" / "docker"


def _examples() -> dict[str, str]:
    env: dict[str, str] = {}
    for name in compose_secrets.FILES:
        env.update(read_env_file(DOCKER / f"{name}.example"))
    return env


def test_the_examples_name_every_credential_and_are_refused_as_they_are() -> None:
    env = _examples()
    assert set(VARIABLES) <= set(env)
    found = problems(env)
    for name in ("S3_ADMIN_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"):
        assert any(line.startswith(f"{name} is still the example's placeholder") for line in found)
    assert "PREFECT_API_AUTH_STRING is still the example's placeholder" in "\n".join(found)


def test_the_quick_start_writes_fresh_private_files_the_check_accepts(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a usual umask: a plain write or `cp` would give 0644
    try:
        written = compose_secrets.write_env_files(tmp_path)
    finally:
        os.umask(old)
    assert sorted(p.name for p in written) == ["ddpflow.env", "s3.env"]
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    env = {**read_env_file(tmp_path / "ddpflow.env"), **read_env_file(tmp_path / "s3.env")}
    assert problems(env) == []
    assert env["AWS_ACCESS_KEY_ID"] != env["S3_ADMIN_ACCESS_KEY_ID"]
    secrets = [env[n] for n, secret in VARIABLES.items() if secret]
    assert len(set(secrets)) == len(secrets), "each placeholder gets its own value"
    files = ["--env-file", str(tmp_path / "ddpflow.env"), "--env-file", str(tmp_path / "s3.env")]
    assert compose_check.main(files) == 0


def test_an_existing_env_file_is_kept_unless_forced(tmp_path: Path) -> None:
    compose_secrets.write_env_files(tmp_path)
    before = (tmp_path / "ddpflow.env").read_text()
    assert compose_secrets.write_env_files(tmp_path) == []
    assert (tmp_path / "ddpflow.env").read_text() == before
    compose_secrets.write_env_files(tmp_path, force=True)
    assert (tmp_path / "ddpflow.env").read_text() != before


def test_the_check_refuses_placeholders_naming_the_variable_not_the_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in _examples().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "a-real-secret-nobody-may-see-1234")
    monkeypatch.delenv("DDPFLOW_HTTPS_CERT", raising=False)
    assert compose_check.main([]) == 2
    err = capsys.readouterr().err
    assert "S3_ADMIN_SECRET_ACCESS_KEY is still the example's placeholder" in err
    assert "MLFLOW_TRACKING_PASSWORD" not in err  # set properly: not reported
    assert "a-real-secret-nobody-may-see" not in err and "change-me-to-a" not in err
    assert "refusing to start the stack" in err


def test_the_check_refuses_short_missing_and_shared_admin_keys() -> None:
    env = {n: f"{n.lower()}-{'x' * 16}" for n in VARIABLES}
    env["PREFECT_API_AUTH_STRING"] = "ddpflow:" + "y" * 32
    assert problems(env) == []
    assert problems(env | {"MLFLOW_TRACKING_PASSWORD": "short"}) == [
        f"MLFLOW_TRACKING_PASSWORD is shorter than 16 characters; {compose_check.FIX}"
    ]
    assert problems(env | {"PREFECT_API_AUTH_STRING": "ddpflow:short"})[0].startswith(
        "PREFECT_API_AUTH_STRING is shorter"
    )
    assert problems({k: v for k, v in env.items() if k != "AWS_SECRET_ACCESS_KEY"}) == [
        f"AWS_SECRET_ACCESS_KEY is not set; {compose_check.FIX}"
    ]
    shared = problems(env | {"S3_ADMIN_ACCESS_KEY_ID": "admin", "AWS_ACCESS_KEY_ID": "admin"})
    assert len(shared) == 1 and shared[0].startswith("AWS_ACCESS_KEY_ID is S3_ADMIN_ACCESS_KEY_ID")
    assert problems(env | {"S3_ADMIN_SECRET_ACCESS_KEY": "short"}) == [
        f"S3_ADMIN_SECRET_ACCESS_KEY is shorter than 16 characters; {compose_check.FIX}"
    ]


def test_the_check_refuses_an_env_file_others_can_read(tmp_path: Path) -> None:
    compose_secrets.write_env_files(tmp_path)
    path = tmp_path / "ddpflow.env"
    path.chmod(0o644)  # what `cp ddpflow.env.example ddpflow.env` leaves under umask 022
    assert compose_check.file_problems(path) == [
        f"{path} is mode 0644, readable by others; run `chmod 600 {path}`"
    ]
    assert compose_check.main(["--env-file", str(path)]) == 2


def test_the_proxy_certificate_must_name_the_published_address(tmp_path: Path) -> None:
    files = make_certs(tmp_path / "https", hosts=["127.0.0.1", "localhost", "10.0.0.5"])
    assert compose_check.cert_problems(files.cert, ["10.0.0.5", "localhost"]) == []
    (missing,) = compose_check.cert_problems(files.cert, ["10.0.0.6", "ddpflow.example.com"])
    assert "does not name 10.0.0.6, ddpflow.example.com" in missing
    assert "python -m infra.certs" in missing
    dask_only = make_certs(tmp_path / "tls")  # no --host: Dask's certificate names no host
    assert compose_check.cert_problems(dask_only.cert, ["127.0.0.1"])
    assert compose_check.cert_problems(tmp_path / "none.pem", ["127.0.0.1"])[0].startswith(
        "no TLS certificate at"
    )
    everywhere = {"DDPFLOW_PUBLISH_ADDRESS": "0.0.0.0", "DDPFLOW_PUBLISH_NAME": "gpu1.lan"}
    assert compose_check.published_hosts(everywhere) == ["gpu1.lan"]
