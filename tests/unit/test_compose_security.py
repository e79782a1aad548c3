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

DOCKER = Path(__file__).resolve().parents[2] / "infra" / "docker"
PLAIN_HTTP_PORTS = {"4200", "5000", "9000", "9001", "8787"}
TLS_PORTS = {"4443": "prefect-server:4200", "5443": "mlflow:5000", "9443": "minio:9000"}


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
    assert set(_env_files(check)) == {"minio.env", "ddpflow.env"}
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


def test_the_workers_s3_key_is_not_minios_root(services: dict) -> None:
    holders = {name for name, s in services.items() if "minio.env" in _env_files(s)}
    assert holders == {"minio", "minio-init", "check-secrets"}
    example = (DOCKER / "ddpflow.env.example").read_text()
    assert "MINIO_ROOT" not in re.sub(r"#.*", "", example)
    assert "MINIO_ROOT_PASSWORD=" in (DOCKER / "minio.env.example").read_text()
    init = services["minio-init"]["command"][0]
    assert 'mc admin user add local "$$AWS_ACCESS_KEY_ID" "$$AWS_SECRET_ACCESS_KEY"' in init
    assert 'mc admin policy attach local ddpflow-bucket --user "$$AWS_ACCESS_KEY_ID"' in init
    policy = json.loads((DOCKER / "minio-ddpflow-policy.json").read_text())
    resources = {r for statement in policy["Statement"] for r in statement["Resource"]}
    assert resources == {"arn:aws:s3:::ddpflow", "arn:aws:s3:::ddpflow/*"}
    actions = {a for statement in policy["Statement"] for a in statement["Action"]}
    assert not any(a.startswith("admin:") or a == "s3:*" for a in actions)
