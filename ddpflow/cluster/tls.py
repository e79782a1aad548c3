"""Mutual TLS for the Kubernetes DaskCluster: certificates from a Secret, tls:// links only.

The Secret holds ca.pem, cert.pem and key.pem (`python -m infra.certs DIR`, then
`kubectl create secret generic NAME --from-file=DIR`). Both pods mount it read-only and get
Dask's own TLS settings, so the scheduler accepts only peers with a certificate from that
CA: whoever reaches port 8786 without one cannot submit work.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ddpflow.config import CLUSTER_ENV, REMOTE_TLS_ENV, ConfigError

log = logging.getLogger(__name__)
MOUNT = "/etc/dask-tls"
VOLUME = "dask-tls"
TLS = "DASK_DISTRIBUTED__COMM__TLS__"


def tls_env() -> dict[str, str]:
    """Dask settings for every role, pointing at the mounted Secret."""
    env = {f"{TLS}CA_FILE": f"{MOUNT}/ca.pem", "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}
    for role in ("CLIENT", "SCHEDULER", "WORKER"):
        env[f"{TLS}{role}__CERT"] = f"{MOUNT}/cert.pem"
        env[f"{TLS}{role}__KEY"] = f"{MOUNT}/key.pem"
    return env


def add_tls(spec: dict[str, Any], secret: str) -> None:
    """Make a make_cluster_spec() DaskCluster use TLS from `secret` (in place)."""
    name = spec["metadata"]["name"]
    # The operator would point workers at tcp://<name>-scheduler...; a set variable wins.
    worker_only = {"DASK_SCHEDULER_ADDRESS": f"tls://{name}-scheduler:8786"}
    for part in ("worker", "scheduler"):
        pod = spec["spec"][part]["spec"]
        # 0o400: only the container's user reads the key.
        pod["volumes"] = [{"name": VOLUME, "secret": {"secretName": secret, "defaultMode": 0o400}}]
        (container,) = pod["containers"]
        container["volumeMounts"] = [{"name": VOLUME, "mountPath": MOUNT, "readOnly": True}]
        extra = {**tls_env(), **(worker_only if part == "worker" else {})}
        container["env"] = [*container.get("env", []), *_env_list(extra)]
    scheduler = spec["spec"]["scheduler"]["spec"]["containers"][0]
    scheduler["args"] = [*scheduler["args"], "--protocol", "tls"]


def refuse_per_run_tls(spec_options: Mapping[str, Any]) -> None:
    """A KubeCluster per flow run cannot use TLS: say so before creating anything."""
    if spec_options.get("tls_secret"):
        raise ConfigError(
            f"{CLUSTER_ENV}=kubernetes cannot use tls_secret: dask-kubernetes' KubeCluster "
            "connects to its scheduler over tcp:// only. Apply the spec as a long-lived "
            "DaskCluster (python -m infra.cluster_specs kubernetes ...) and connect with "
            "DDPFLOW_DASK_ADDRESS=tls://NAME-scheduler:8786, or drop tls_secret and set "
            f"{REMOTE_TLS_ENV}=0 to start it on plain tcp://"
        )


def refuse_plain_kubecluster(tls: bool) -> None:
    """A KubeCluster per flow run listens on plain tcp:// (see refuse_per_run_tls): anyone who
    reaches its scheduler's port (any pod in the Kubernetes cluster, unless a NetworkPolicy
    stops it) runs code on the workers with the artifact store's keys, and a worker anyone
    starts joins and is taken as a DDP rank. So it starts only when the user turned TLS off
    for it, with a warning; otherwise the refusal names the way with TLS."""
    if tls:
        raise ConfigError(
            f"{CLUSTER_ENV}=kubernetes would start a KubeCluster whose scheduler takes plain "
            "tcp:// from anyone who reaches it (dask-kubernetes' KubeCluster cannot use TLS): "
            "they could run code on its workers with their credentials. Apply the spec as a "
            "long-lived DaskCluster with tls_secret (python -m infra.cluster_specs kubernetes "
            "OPTIONS.json, then kubectl apply) and connect with "
            "DDPFLOW_DASK_ADDRESS=tls://NAME-scheduler:8786; or, where only you reach its "
            f"pods, set {REMOTE_TLS_ENV}=0 to start it on plain tcp://"
        )
    log.warning(
        "%s=0: the KubeCluster this flow starts takes plain tcp:// without credentials; anyone "
        "who reaches its scheduler can run code on its workers with their credentials",
        REMOTE_TLS_ENV,
    )


def _env_list(env: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": key, "value": value} for key, value in env.items()]
