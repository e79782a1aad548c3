"""compose.yaml's security settings, parsed (no Docker engine here; infra/README.md says what a
real compose run would add).

MLflow's Host check is MLflow's own middleware (`mlflow.server.security`) on a small Flask app,
configured from the value compose sets: MLflow 3 answers 403 to a Host header it does not
know, and the compose clients send `mlflow:5000`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from infra import compose_secrets
from infra.compose_check import read_env_file
from infra.seaweedfs import serve
from infra.seaweedfs.config import write_config

DOCKER = Path(__file__).resolve().parents[2] / "infra" / "docker"
PLAIN_HTTP_PORTS = {"4200", "5000", "9000", "8787"}
TLS_PORTS = {"4443": "prefect-server:4200", "5443": "mlflow:5000", "9443": "s3:9000"}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` interpolation (the only form compose.yaml uses)."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)


def _env_files(service: dict) -> list[str]:
    files = service.get("env_file") or []
    return [files] if isinstance(files, str) else files


def _mlflow_status(allowed_hosts: str | None, host: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """The status MLflow's security middleware gives an API request with this Host header."""
    from flask import Flask
    from mlflow.server.security import init_security_middleware

    if allowed_hosts is None:
        monkeypatch.delenv("MLFLOW_SERVER_ALLOWED_HOSTS", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_SERVER_ALLOWED_HOSTS", allowed_hosts)
    app = Flask("mlflow-host-check")
    app.add_url_rule("/api/2.0/mlflow/experiments/search", "search", lambda: "ok")
    init_security_middleware(app)
    response = app.test_client().get("/api/2.0/mlflow/experiments/search", headers={"Host": host})
    return response.status_code


def test_mlflow_accepts_the_hosts_its_clients_send(
    services: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    setting = services["mlflow"]["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"]
    # Without it, MLflow's default list (localhost, private IPs) refuses the compose clients.
    assert _mlflow_status(None, "mlflow:5000", monkeypatch) == 403
    local = _interpolate(setting, {})
    for host in ("mlflow:5000", "127.0.0.1:5000", "localhost:5000", "127.0.0.1:5443"):
        assert _mlflow_status(local, host, monkeypatch) == 200, host
    published = _interpolate(
        setting, {"DDPFLOW_PUBLISH_ADDRESS": "10.0.0.5", "DDPFLOW_PUBLISH_NAME": "gpu1.lan"}
    )
    for host in ("mlflow:5000", "10.0.0.5:5443", "gpu1.lan:5443"):
        assert _mlflow_status(published, host, monkeypatch) == 200, host
    for host in ("evil.example:5000", "10.0.0.5:5000", "mlflow.evil.example:5000"):
        assert _mlflow_status(published, host, monkeypatch) == 403, host
    assert "*" not in published, "no wildcard: the DNS-rebinding check stays on"


def test_every_service_waits_for_the_credentials_check(services: dict) -> None:
    check = services["check-secrets"]
    assert check["command"] == "python -m infra.compose_check"
    assert set(_env_files(check)) == {"s3.env", "ddpflow.env"}
    assert check["environment"]["DDPFLOW_HTTPS_CERT"] == "/etc/ddpflow-https/cert.pem"
    assert "./https:/etc/ddpflow-https:ro" in check["volumes"]

    def waits(name: str) -> bool:
        depends = services[name].get("depends_on") or {}
        if depends.get("check-secrets", {}).get("condition") == "service_completed_successfully":
            return True
        return any(waits(dep) for dep in depends)

    for name in services:
        if name != "check-secrets":
            assert waits(name), f"{name} can start before the credentials are checked"


def _bindings(services: dict, env: dict[str, str]) -> dict[str, str]:
    """container port -> host address it is published on, as compose would render it."""
    bound = {}
    for service in services.values():
        for port in service.get("ports", []):
            address, _, container = _interpolate(port, env).rpartition(":")
            bound[container] = address.rsplit(":", 1)[0]
    return bound


def test_plain_http_stays_on_this_host_and_other_machines_get_tls(services: dict) -> None:
    for env in ({}, {"DDPFLOW_PUBLISH_ADDRESS": "10.0.0.5"}):
        bound = _bindings(services, env)
        published = env.get("DDPFLOW_PUBLISH_ADDRESS", "127.0.0.1")
        for port in PLAIN_HTTP_PORTS:
            assert bound[port] == "127.0.0.1", f"plain HTTP on {port} would leave the host"
        for port in [*TLS_PORTS, "8786"]:  # the proxy, and Dask's mutual TLS
            assert bound[port] == published, port
    assert set(PLAIN_HTTP_PORTS | set(TLS_PORTS) | {"8786"}) == set(_bindings(services, {}))


def test_the_proxy_serves_each_http_service_over_tls(services: dict) -> None:
    proxy = services["tls-proxy"]
    assert "./nginx-tls.conf:/etc/nginx/conf.d/default.conf:ro" in proxy["volumes"]
    assert "./https:/etc/ddpflow-https:ro" in proxy["volumes"]
    conf = (DOCKER / "nginx-tls.conf").read_text()
    servers = re.findall(r"listen (\d+) ssl;\s*location / \{ proxy_pass http://([\w:-]+); \}", conf)
    assert dict(servers) == TLS_PORTS
    assert "ssl_certificate /etc/ddpflow-https/cert.pem;" in conf
    assert "ssl_certificate_key /etc/ddpflow-https/key.pem;" in conf
    assert "proxy_set_header Host $http_host;" in conf  # S3 signatures and MLflow's check
    assert re.search(r"^\s*listen \d+;", conf, re.M) is None, "no plain-HTTP listener"


def test_the_workers_s3_key_is_not_the_s3_administrators(services: dict) -> None:
    holders = {name for name, s in services.items() if "s3.env" in _env_files(s)}
    assert holders == {"s3", "check-secrets"}
    example = re.sub(r"#.*", "", (DOCKER / "ddpflow.env.example").read_text())
    assert "S3_ADMIN" not in example
    assert "S3_ADMIN_SECRET_ACCESS_KEY=" in (DOCKER / "s3.env.example").read_text()
    command = services["s3"]["command"]
    assert command.startswith("python -m infra.seaweedfs.serve ") and "--bucket ddpflow" in command


def test_the_s3_service_gives_the_workers_the_bucket_alone(tmp_path: Path) -> None:
    """The identities serve writes from the quick start's env files: the administrator's key
    is s3.env's, the workers' key ddpflow.env's, limited to the bucket ddpflow."""
    compose_secrets.write_env_files(tmp_path)
    env = {**read_env_file(tmp_path / "ddpflow.env"), **read_env_file(tmp_path / "s3.env")}
    config = write_config(tmp_path / "weed", serve.identities_from_env(env, "ddpflow"))
    written = json.loads(config.identities.read_text())["identities"]
    by_key = {i["credentials"][0]["accessKey"]: i for i in written}
    assert set(by_key) == {env["S3_ADMIN_ACCESS_KEY_ID"], env["AWS_ACCESS_KEY_ID"]}
    worker = by_key[env["AWS_ACCESS_KEY_ID"]]
    assert worker["credentials"][0]["secretKey"] == env["AWS_SECRET_ACCESS_KEY"]
    assert worker["actions"] == ["Read:ddpflow", "Write:ddpflow", "List:ddpflow", "Tagging:ddpflow"]
    admin = by_key[env["S3_ADMIN_ACCESS_KEY_ID"]]
    assert admin["credentials"][0]["secretKey"] == env["S3_ADMIN_SECRET_ACCESS_KEY"]
    assert "Admin" in admin["actions"]


def test_serve_refuses_a_missing_or_shared_key_naming_the_variable() -> None:
    env = {
        "S3_ADMIN_ACCESS_KEY_ID": "admin-id",
        "S3_ADMIN_SECRET_ACCESS_KEY": "admin-secret-value-1234",
        "AWS_ACCESS_KEY_ID": "worker-id",
        "AWS_SECRET_ACCESS_KEY": "worker-secret-value-1234",
    }
    with pytest.raises(serve.ConfigError) as missing:
        serve.identities_from_env({**env, "S3_ADMIN_SECRET_ACCESS_KEY": " "}, "ddpflow")
    assert "S3_ADMIN_SECRET_ACCESS_KEY not set" in str(missing.value)
    with pytest.raises(serve.ConfigError) as shared:
        serve.identities_from_env({**env, "AWS_ACCESS_KEY_ID": "admin-id"}, "ddpflow")
    assert str(shared.value).startswith("AWS_ACCESS_KEY_ID is S3_ADMIN_ACCESS_KEY_ID")
    for error in (missing.value, shared.value):
        assert not any(value in str(error) for value in env.values())
    # weed gets a program's environment, none of the container's credentials.
    weed_env = serve.weed_env({**env, "PATH": "/usr/bin", "PREFECT_API_AUTH_STRING": "u:p"})
    assert weed_env == {"PATH": "/usr/bin"}


def test_every_s3_client_of_the_recipe_uses_the_s3_service(services: dict) -> None:
    endpoints = {
        name: service["environment"]["AWS_ENDPOINT_URL_S3"]
        for name, service in services.items()
        if isinstance(service.get("environment"), dict)
        and "AWS_ENDPOINT_URL_S3" in service["environment"]
    }
    assert {"mlflow", "prefect-worker", "dask-cpu-worker", "dask-gpu-worker-0"} <= set(endpoints)
    assert set(endpoints.values()) == {"http://s3:9000"}
    assert services["s3"]["ports"] == ["127.0.0.1:9000:9000"]
    assert services["mlflow"]["depends_on"]["s3"] == {"condition": "service_healthy"}
    # Healthy only once serve has made the bucket (it writes `ready` after that).
    config = re.search(r"--config (\S+)", services["s3"]["command"]).group(1)
    ready = f"{config}/{serve.READY}"
    assert services["s3"]["healthcheck"]["test"] == ["CMD", "test", "-f", ready]
    # ...and not by a `ready` left from the container's last start: a tmpfs, new each start.
    assert any(config.startswith(f"{mount}/") for mount in services["s3"]["tmpfs"]), config
