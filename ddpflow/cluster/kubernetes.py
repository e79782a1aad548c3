"""The `kubernetes` cluster kind: a dask-kubernetes DaskCluster spec for the Dask operator.

Built from DDPFLOW_CLUSTER_OPTIONS: the spec keys below shape the resource (image, workers,
GPUs, secrets, TLS), the other keys go to KubeCluster itself. The workers get the same
settings as every ddpflow DDP worker (ddpflow.cluster.workers.WORKER_ENV).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distributed.deploy import Cluster

from ddpflow.cluster.extras import require_extra
from ddpflow.cluster.tls import add_tls, refuse_per_run_tls, refuse_plain_kubecluster
from ddpflow.cluster.workers import GPU_RESOURCE, WORKER_CLI_ARGS, WORKER_ENV
from ddpflow.config import ConfigError

DEFAULT_IMAGE = "ddpflow:latest"
# Keys of DDPFLOW_CLUSTER_OPTIONS (kubernetes) that shape the DaskCluster spec; the
# others go to KubeCluster itself (namespace, resource_timeout, ...).
KUBERNETES_SPEC_KEYS = (
    "name",
    "image",
    "n_workers",
    "resources",
    "scheduler_resources",
    "worker_command",
    "env",
    "env_secret",
    "tls_secret",
)


def kubernetes_cluster(
    options: dict[str, Any], env: Mapping[str, str], tls: bool = True
) -> Cluster:
    """A KubeCluster from the spec keys of `options`; the rest are KubeCluster's own.

    Its scheduler listens on plain tcp://, so with `tls` (the default) it is refused before
    anything is created, naming the long-lived DaskCluster with TLS instead
    (ddpflow.cluster.tls.refuse_plain_kubecluster); `tls=False` starts it, with a warning.
    """
    operator = require_extra("kubernetes")
    spec_options = {k: options.pop(k) for k in KUBERNETES_SPEC_KEYS if k in options}
    refuse_per_run_tls(spec_options)
    refuse_plain_kubecluster(tls)
    spec = kubernetes_spec(spec_options, env)
    return operator.KubeCluster(custom_cluster_spec=spec, **options)


def kubernetes_spec(options: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict:
    """A dask-kubernetes `DaskCluster` resource for the Dask operator (kubectl apply -f).

    Keys: name, image, n_workers, resources (each worker container's Kubernetes resources,
    e.g. {"limits": {"nvidia.com/gpu": 1}}: the worker then declares GPU=<that count>),
    scheduler_resources, worker_command, env (plain variables), env_secret (a Secret whose
    keys become variables, e.g. the AWS credentials; no secret value is ever in the spec),
    tls_secret (a Secret with ca.pem, cert.pem, key.pem: mutual TLS, see ddpflow.cluster.tls).
    """
    operator = require_extra("kubernetes")
    unknown = sorted(set(options) - set(KUBERNETES_SPEC_KEYS))
    if unknown:
        raise ConfigError(f"unknown Kubernetes spec options {unknown}; use {KUBERNETES_SPEC_KEYS}")
    resources = options.get("resources")
    gpus = ((resources or {}).get("limits") or {}).get("nvidia.com/gpu")
    command = " ".join(["dask worker --nthreads 1", *WORKER_CLI_ARGS])
    command += f" --resources {GPU_RESOURCE}={gpus}" if gpus else ""
    spec = operator.make_cluster_spec(
        name=options.get("name", "ddpflow"),
        image=options.get("image", DEFAULT_IMAGE),
        n_workers=options.get("n_workers", 2),
        resources=resources,
        env={**WORKER_ENV, **dict(options.get("env") or {}), **dict(env or {})},
        worker_command=options.get("worker_command", command),
    )
    containers = [
        spec["spec"]["worker"]["spec"]["containers"][0],
        spec["spec"]["scheduler"]["spec"]["containers"][0],
    ]
    # make_cluster_spec gives the scheduler the workers' resources (it would hold a GPU)
    # and the legacy `dask-scheduler` command, which current distributed no longer ships.
    containers[1]["resources"] = options.get("scheduler_resources")
    containers[1]["args"] = ["dask", "scheduler", *containers[1]["args"][1:]]
    if options.get("env_secret"):  # only the workers touch the artifact store
        containers[0]["envFrom"] = [{"secretRef": {"name": options["env_secret"]}}]
    if options.get("tls_secret"):
        add_tls(spec, options["tls_secret"])
    return _without_nulls(spec)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
