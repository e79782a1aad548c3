"""infra/ files that cannot run here (no Docker engine, no Kubernetes): parsed and checked.

compose.yaml: it parses and has the services, GPU workers and no secret values.
Dockerfile: one image from the lock. Kubernetes: the DaskCluster YAML is what ddpflow
generates from the options file, and each pod/service spec survives a round trip through
the official Kubernetes client's models (unknown or mistyped fields would not).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from ddpflow.cluster.kubernetes import kubernetes_spec
from ddpflow.cluster.workers import WORKER_CLI_ARGS, WORKER_ENV

INFRA = Path(__file__).resolve().parents[2] / "infra"
COMPOSE = INFRA / "docker" / "compose.yaml"
SECRET_NAMES = re.compile(r"SECRET|PASSWORD|ACCESS_KEY|TOKEN|API_KEY|ROOT_USER", re.I)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_the_production_services(compose: dict) -> None:
    services = compose["services"]
    for name in (
        "prefect-server",
        "prefect-worker",
        "mlflow",
        "s3",
        "dask-scheduler",
        "dask-cpu-worker",
        "dask-gpu-worker-0",
        "dask-gpu-worker-1",
    ):
        assert name in services, name
    images = {s.get("image") for n, s in services.items() if n != "tls-proxy"}
    assert images == {"ddpflow:latest"}, "one image for the runner, every Dask process and S3"
    assert services["prefect-worker"]["build"]["dockerfile"] == "infra/docker/Dockerfile"


def test_gpu_workers_declare_one_gpu_and_reserve_one_device(compose: dict) -> None:
    gpu_workers = {n: s for n, s in compose["services"].items() if n.startswith("dask-gpu")}
    devices = []
    for service in gpu_workers.values():
        assert "--resources GPU=1" in service["command"]
        assert "--nthreads 1" in service["command"]
        (reservation,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and reservation["capabilities"] == ["gpu"]
        devices += reservation["device_ids"]
    assert sorted(devices) == ["0", "1"], "each GPU worker has its own GPU"
    cpu = compose["services"]["dask-cpu-worker"]["command"]
    assert "--resources CPU=" in cpu and "GPU" not in cpu


def test_compose_uses_the_contract_variables(compose: dict) -> None:
    env = compose["services"]["prefect-worker"]["environment"]
    assert env["DDPFLOW_DASK_ADDRESS"] == "tls://dask-scheduler:8786"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["DDPFLOW_ARTIFACT_ROOT"].startswith("s3://")
    assert env["AWS_ENDPOINT_URL_S3"] == "http://s3:9000"
    assert json.loads(env["DDPFLOW_RANK_RESOURCES"]) == {"GPU": 1}


def test_compose_holds_no_secret_values(compose: dict) -> None:
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        pairs = env.items() if isinstance(env, dict) else (e.partition("=")[::2] for e in env)
        leaked = [k for k, v in pairs if SECRET_NAMES.search(k) and not str(v).startswith("${")]
        assert not leaked, f"{name} has literal secrets {leaked}; use env_file"
    users = [n for n, s in compose["services"].items() if s.get("env_file")]
    assert {"s3", "mlflow", "prefect-worker", "dask-gpu-worker-0"} <= set(users)
    example = (INFRA / "docker" / "ddpflow.env.example").read_text()
    example += (INFRA / "docker" / "s3.env.example").read_text()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_ADMIN_SECRET_ACCESS_KEY"):
        assert f"{key}=" in example


def test_dockerfile_installs_the_lock() -> None:
    text = (INFRA / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert "COPY pyproject.toml constraints.txt" in text
    assert "pip install -c constraints.txt" in text
    for directory in ("ddpflow", "flows", "tasks", "infra", "deployments"):
        assert f"COPY {directory} {directory}" in text
    for name, value in WORKER_ENV.items():  # the image's workers get ddpflow's settings
        assert f"{name}={value}" in text or f'{name}="{value}"' in text, name


def _spec_options() -> dict:
    return json.loads((INFRA / "kubernetes" / "cluster-options.json").read_text())


def test_the_shipped_daskcluster_yaml_is_the_generated_spec() -> None:
    shipped = yaml.safe_load((INFRA / "kubernetes" / "daskcluster.yaml").read_text())
    assert shipped == kubernetes_spec(_spec_options()), (
        "regenerate: python -m infra.cluster_specs kubernetes "
        "infra/kubernetes/cluster-options.json > infra/kubernetes/daskcluster.yaml"
    )


def test_the_daskcluster_spec_validates() -> None:
    from kubernetes.client import ApiClient

    spec = kubernetes_spec(_spec_options())
    assert (spec["apiVersion"], spec["kind"]) == ("kubernetes.dask.org/v1", "DaskCluster")
    assert {"scheduler", "worker"} <= set(spec["spec"])  # required by the CRD
    api = ApiClient()
    parts = [
        (spec["spec"]["worker"]["spec"], "V1PodSpec"),
        (spec["spec"]["scheduler"]["spec"], "V1PodSpec"),
        (spec["spec"]["scheduler"]["service"], "V1ServiceSpec"),
    ]
    for part, model in parts:
        parsed = api._ApiClient__deserialize(part, model)  # validates types and required fields
        assert api.sanitize_for_serialization(parsed) == part, f"{model} lost or changed fields"


def test_gpu_workers_in_kubernetes() -> None:
    spec = kubernetes_spec(_spec_options())
    (worker,) = spec["spec"]["worker"]["spec"]["containers"]
    (scheduler,) = spec["spec"]["scheduler"]["spec"]["containers"]
    assert worker["args"][:4] == ["dask", "worker", "--nthreads", "1"]
    # ddpflow's worker flags, then the GPU resource
    assert worker["args"][4:8] == [*WORKER_CLI_ARGS, "--resources", "GPU=1"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in str(scheduler.get("resources")), "the scheduler needs no GPU"
    assert scheduler["args"][:2] == ["dask", "scheduler"]
    assert worker["envFrom"] == [{"secretRef": {"name": "ddpflow-s3"}}]
    names = {e["name"] for e in worker["env"]}
    assert "DASK_DISTRIBUTED__WORKER__DAEMON" in names
    assert not any(SECRET_NAMES.search(n) for n in names), "secrets come from the Secret"


def test_a_cpu_only_kubernetes_spec_declares_no_gpu() -> None:
    spec = kubernetes_spec({"image": "ddpflow:latest", "n_workers": 3})
    (worker,) = spec["spec"]["worker"]["spec"]["containers"]
    assert spec["spec"]["worker"]["replicas"] == 3
    assert "--resources" not in worker["args"]


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` interpolation (the only form compose.yaml uses)."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), str(text))


def _published(compose: dict, env: dict[str, str]) -> dict[str, list[str]]:
    """service -> the host addresses its published ports bind, as compose would render them."""
    hosts = {}
    for name, service in compose["services"].items():
        ports = [_interpolate(p, env) for p in service.get("ports", [])]
        hosts[name] = [p.rsplit(":", 2)[0] if p.count(":") == 2 else "ALL" for p in ports]
    return hosts


def test_compose_publishes_on_loopback_unless_told_otherwise(compose: dict) -> None:
    default = _published(compose, {})
    assert {"s3", "prefect-server", "mlflow", "dask-scheduler", "tls-proxy"} <= set(default)
    assert {h for hosts in default.values() for h in hosts} == {"127.0.0.1"}
    # Only TLS leaves the host (test_compose_security.py has the ports).
    chosen = _published(compose, {"DDPFLOW_PUBLISH_ADDRESS": "10.0.0.5"})
    assert set(chosen["tls-proxy"]) == {"10.0.0.5"}
    assert {h for hosts in chosen.values() for h in hosts} == {"10.0.0.5", "127.0.0.1"}


def _env_of(service: dict) -> dict:
    return service.get("environment") or {}


def test_compose_servers_require_credentials(compose: dict) -> None:
    services = compose["services"]
    dask = [n for n in services if n.startswith("dask-")]
    assert "--protocol tls" in services["dask-scheduler"]["command"]
    for name in [*dask, "prefect-worker"]:
        env = _env_of(services[name])
        assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True", name
        for key in ("CA_FILE", "CLIENT__CERT", "SCHEDULER__KEY", "WORKER__CERT", "WORKER__KEY"):
            assert env[f"DASK_DISTRIBUTED__COMM__TLS__{key}"].startswith("/etc/dask-tls/"), name
        assert "./tls:/etc/dask-tls:ro" in services[name]["volumes"], name
    for name in dask[1:]:
        assert services[name]["command"].startswith("dask worker tls://dask-scheduler:8786")
    assert "tcp://" not in COMPOSE.read_text(), "no unencrypted Dask address left"
    prefect = " ".join(services["prefect-server"]["command"])
    assert 'PREFECT_SERVER_API_AUTH_STRING="$$PREFECT_API_AUTH_STRING"' in prefect
    assert "prefect-server" in [n for n, s in services.items() if s.get("env_file")]
    mlflow = " ".join(services["mlflow"]["command"])
    assert "--app-name basic-auth" in mlflow
    ini = (INFRA / "docker" / "mlflow-auth.ini").read_text()
    assert "database_uri = sqlite:////data/" in ini and "admin_password" not in ini
    example = (INFRA / "docker" / "ddpflow.env.example").read_text()
    for key in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_FLASK_SERVER"):
        assert f"\n{key}" in example, key


def test_the_shipped_kubernetes_spec_carries_tls() -> None:
    spec = kubernetes_spec(_spec_options())
    name = spec["metadata"]["name"]
    for part in ("worker", "scheduler"):
        pod = spec["spec"][part]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True", part
        assert env["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"] == "/etc/dask-tls/ca.pem", part
        assert container["volumeMounts"][0]["mountPath"] == "/etc/dask-tls"
        assert pod["volumes"][0]["secret"]["secretName"] == "ddpflow-dask-tls"
    (worker,) = spec["spec"]["worker"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["DASK_SCHEDULER_ADDRESS"] == f"tls://{name}-scheduler:8786"
    (scheduler,) = spec["spec"]["scheduler"]["spec"]["containers"]
    assert scheduler["args"][-2:] == ["--protocol", "tls"]


def test_a_per_run_kubecluster_with_tls_is_refused_up_front() -> None:
    from ddpflow.cluster.build import build_cluster
    from ddpflow.config import ConfigError

    with pytest.raises(ConfigError, match="tls_secret.*DDPFLOW_DASK_ADDRESS=tls://"):
        build_cluster("kubernetes", _spec_options())
