"""Build the Dask cluster the flows run on; DDPFLOW_CLUSTER picks the kind.

Every kind is one of Dask's own deployment classes: `local` (LocalCluster), `cuda`
(dask-cuda's LocalCUDACluster), `jobqueue` (dask-jobqueue's SLURMCluster, PBSCluster, ...)
and `kubernetes` (dask-kubernetes' KubeCluster). The optional packages are imported only
when their kind is used; a missing one raises ConfigError naming the extra to install.
`address` (an existing scheduler) builds nothing: the task runner connects to it.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from typing import Any

import dask
import distributed
from distributed.deploy import Cluster

from ddpflow.cluster.dashboard import scheduler_http_routes
from ddpflow.cluster.extras import require_extra
from ddpflow.cluster.forkserver import fork_workers_from_a_preloaded_server
from ddpflow.cluster.jobqueue_tls import jobqueue_security, removing_folder_on_close
from ddpflow.cluster.kept_nannies import KeptNanniesCluster
from ddpflow.cluster.local_tls import local_security
from ddpflow.cluster.workers import (
    CPU_RESOURCE,
    GPU_RESOURCE,
    PRE_SPAWN_ENVIRON,
    WORKER_CLI_ARGS,
    WORKER_CONFIG,
    WORKER_ENV,
)
from ddpflow.config import CLUSTER_ENV, DEFAULT_NUM_WORKERS, ConfigError

JOBQUEUE_CLASSES = {
    "slurm": "SLURMCluster",
    "pbs": "PBSCluster",
    "sge": "SGECluster",
    "lsf": "LSFCluster",
    "htcondor": "HTCondorCluster",
    "oar": "OARCluster",
}
# Dashboards (and the HTTP server with /health, /metrics) of clusters on this machine: on
# loopback only; a bare ":0" listens on every interface even with host="127.0.0.1". A free
# port, so concurrent runs do not clash on 8787.
LOOPBACK_DASHBOARD = "127.0.0.1:0"


def local_cluster(
    num_workers: int = 2,
    env: Mapping[str, str] | None = None,
    local_directory: str | None = None,
    quiet: bool = True,
    tls: bool = True,
    **cluster_kwargs: Any,
) -> distributed.LocalCluster:
    """Worker processes with one thread each (one rank per worker), bound to 127.0.0.1.

    With `tls` (the default) every scheduler, nanny and worker listener takes only peers with
    this cluster's own temporary certificate, on tls:// (ddpflow.cluster.local_tls); connect
    with `distributed.Client(cluster)`, which takes the credentials from the cluster object.
    `tls=False` gives plain tcp://, which any local user can reach (DDPFLOW_LOCAL_CLUSTER_TLS).
    `cluster_kwargs` go to LocalCluster (e.g. threads_per_worker, resources).
    """
    security = local_security(tls, cluster_kwargs)
    dask.config.set(WORKER_CONFIG)
    fork_workers_from_a_preloaded_server()
    if quiet:
        # Dask's INFO lines (every nanny and client start/stop) drown the flow's own output;
        # warnings and errors still show. Worker processes set up their logging when they
        # import distributed, before the nanny's `env` reaches them: so a pre-spawn variable.
        logging.getLogger("distributed").setLevel(logging.WARNING)
        dask.config.set({f"{PRE_SPAWN_ENVIRON}.DASK_LOGGING__DISTRIBUTED": "warning"})
    kwargs: dict[str, Any] = {
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": LOOPBACK_DASHBOARD,
        "local_directory": local_directory,
        **security,
        **cluster_kwargs,
    }
    kwargs["env"] = {**dict(env or {}), **dict(cluster_kwargs.get("env") or {})}
    # The scheduler reads its routes when it starts, here in this process (as the cuda and
    # jobqueue kinds' do; kubernetes' runs in its own pod with Dask's defaults).
    with dask.config.set(scheduler_http_routes()):
        return KeptNanniesCluster(n_workers=num_workers, **kwargs)


def build_cluster(
    kind: str,
    options: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    tls: bool = True,
) -> Cluster:
    """The cluster of `kind`, with DDPFLOW_CLUSTER_OPTIONS passed through to its class.

    `env` is extra environment for the workers (e.g. PREFECT_API_URL). `tls`: the cluster
    uses TLS with credentials made for it (local, cuda: DDPFLOW_LOCAL_CLUSTER_TLS; jobqueue:
    DDPFLOW_REMOTE_CLUSTER_TLS); for kubernetes, whose KubeCluster cannot, it refuses to
    start one (DDPFLOW_REMOTE_CLUSTER_TLS=0 starts it on plain tcp://).
    """
    options = dict(options or {})
    env = dict(env or {})
    if kind == "local":
        workers = options.pop("n_workers", DEFAULT_NUM_WORKERS)
        return local_cluster(workers, env=env, tls=tls, **options)
    if kind == "cuda":
        return cuda_cluster(options, env, tls=tls)
    if kind == "jobqueue":
        return jobqueue_cluster(options, env, tls=tls)
    if kind == "kubernetes":
        # Imported here: the module builds on this one's worker settings.
        from ddpflow.cluster.kubernetes import kubernetes_cluster

        return kubernetes_cluster(options, env, tls=tls)
    raise ConfigError(
        f"cluster kind {kind!r} cannot be built: use local, cuda, jobqueue or kubernetes "
        f"({CLUSTER_ENV}=address connects to DDPFLOW_DASK_ADDRESS instead)"
    )


def cuda_cluster(options: Mapping[str, Any], env: Mapping[str, str], tls: bool = True) -> Cluster:
    """dask-cuda: one worker per GPU, each with its CUDA_VISIBLE_DEVICES rotated so that
    its own GPU is cuda:0; every worker declares the GPU resource the ranks ask for.
    With `tls`, the same per-run TLS as the local kind (LocalCUDACluster is a LocalCluster)."""
    dask_cuda = require_extra("cuda")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"cluster kind 'cuda' ({CLUSTER_ENV}=cuda) needs NVIDIA GPUs, but CUDA is not "
            "available in this process (torch.cuda.is_available() is False); use "
            f"{CLUSTER_ENV}=local on a machine without GPUs"
        )
    security = local_security(tls, options)
    dask.config.set(WORKER_CONFIG)
    kwargs = {
        "threads_per_worker": 1,
        "host": "127.0.0.1",
        "dashboard_address": LOOPBACK_DASHBOARD,
        "resources": {GPU_RESOURCE: 1},
        **security,
        **options,
    }
    # LocalCUDACluster replaces each worker's `env` with its CUDA_VISIBLE_DEVICES, so the
    # extra environment goes through the nanny's config instead.
    environ = {**dask.config.get("distributed.nanny.environ"), **env}
    with dask.config.set({"distributed.nanny.environ": environ, **scheduler_http_routes()}):
        return dask_cuda.LocalCUDACluster(**kwargs)


def nccl_interface_env(interface: str | None) -> dict[str, str]:
    """NCCL's bootstrap on the interface the Dask worker listens on (`interface` option).

    Gloo ranks bind their worker's address through the process group's options; NCCL only
    reads NCCL_SOCKET_IFNAME, from the environment the worker starts with ('=' asks for
    exactly that interface). One set in the options' own job_script_prologue comes later and
    wins.
    """
    return {"NCCL_SOCKET_IFNAME": f"={interface}"} if interface else {}


def jobqueue_cluster(
    options: Mapping[str, Any], env: Mapping[str, str], tls: bool = True
) -> Cluster:
    """A batch-queue cluster; each worker is a job. Nothing is submitted unless the options
    ask for workers (`n_workers`) or the cluster is scaled later.

    ddpflow's own keys: `system` (slurm, pbs, sge, lsf, htcondor, oar; default slurm).
    `processes` defaults to 1: one worker, so one DDP rank, per job. With `tls` (the default;
    DDPFLOW_REMOTE_CLUSTER_TLS) the scheduler and the jobs' workers take only peers with the
    cluster's own certificate, on tls:// (ddpflow.cluster.jobqueue_tls); the jobs read it from
    a 0700 folder inside `shared_temp_directory` (default: the home folder), removed when
    the cluster closes.
    """
    module = require_extra("jobqueue")
    options = dict(options)
    system = str(options.pop("system", "slurm")).lower()
    if system not in JOBQUEUE_CLASSES:
        raise ConfigError(
            f"{CLUSTER_ENV}=jobqueue: system={system!r} is not one of "
            f"{', '.join(JOBQUEUE_CLASSES)} (set it in DDPFLOW_CLUSTER_OPTIONS)"
        )
    worker_env = {**WORKER_ENV, **nccl_interface_env(options.get("interface")), **env}
    exports = [f"export {k}={shlex.quote(str(v))}" for k, v in worker_env.items()]
    options["job_script_prologue"] = exports + list(options.get("job_script_prologue") or [])
    options["worker_extra_args"] = [*WORKER_CLI_ARGS, *(options.get("worker_extra_args") or [])]
    options.setdefault("processes", 1)
    scheduler_options = options.get("scheduler_options") or {}
    # The scheduler itself listens where the jobs reach it; its dashboard only on loopback
    # (an SSH tunnel reaches it), unless scheduler_options say otherwise.
    options["scheduler_options"] = {"dashboard_address": LOOPBACK_DASHBOARD, **scheduler_options}
    folder = jobqueue_security(tls, options, str(options.get("config_name") or system))
    cls = getattr(module, JOBQUEUE_CLASSES[system])
    with dask.config.set(scheduler_http_routes()):  # its scheduler starts in this process
        if folder is None:
            return cls(**options)
        try:
            return removing_folder_on_close(cls)(tls_folder=folder, **options)
        except BaseException:
            folder.remove()  # a class that refused its options made no cluster to close
            raise


def task_placement(workers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Dask annotations that keep non-rank tasks on the CPU workers, where there are any.

    CPU workers say so by declaring the CPU resource (`dask worker ... --resources CPU=4`,
    as many as threads); GPU workers declare GPU only. A task that asks for CPU=1 then never
    runs on a GPU worker, work stealing included, and a restarted CPU worker declares it
    again. Without any CPU worker the tasks run anywhere. `workers` is
    `ddpflow.distributed.cluster_workers(client)`.
    """
    if any((info.get("resources") or {}).get(CPU_RESOURCE, 0) > 0 for info in workers.values()):
        return {"resources": {CPU_RESOURCE: 1}}
    return {}
