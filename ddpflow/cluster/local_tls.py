"""Per-run TLS credentials for the clusters ddpflow starts on this machine (local, cuda).

A Dask scheduler, its workers and its nannies run whatever a connected client sends
(`Client(address).run(os.system, ...)`), as the user who started them. On plain tcp:// any
other user of a shared GPU box or login node who finds the port can do that with the flow's
AWS, MLflow and Prefect credentials. So each cluster gets a fresh self-signed certificate
(Dask's `Security.temporary()`): every listener requires it (mutual TLS), and only the
processes it is handed to hold it. It lives in memory: the flow's client gets it from the
cluster object, the nannies and workers through their start arguments (pickled over the
forkserver's pipe, not on a command line or in the environment), and a worker's own client
(`distributed.get_client()`) from its worker. Dask writes the key to a file only for the
moment ssl loads it, inside a fresh 0700 temporary folder that it removes at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distributed.security import Security

from ddpflow.config import CLUSTER_OPTIONS_ENV, LOCAL_TLS_ENV, ConfigError


def local_security(tls: bool, options: Mapping[str, Any]) -> dict[str, Any]:
    """The LocalCluster keyword arguments that make it use TLS ({} with `tls` off).

    `options` are the other LocalCluster arguments (DDPFLOW_CLUSTER_OPTIONS included): one
    that asks for its own security or a non-TLS protocol contradicts the setting, and is
    refused before anything starts.
    """
    if not tls:
        return {}
    protocol = str(options.get("protocol") or "tls").removesuffix("://")
    if "security" in options or protocol != "tls":
        raise ConfigError(
            f"{CLUSTER_OPTIONS_ENV} sets {'security' if 'security' in options else 'protocol'}"
            f"={options.get('security', options.get('protocol'))!r}, but the local cluster "
            f"already uses TLS with per-run credentials; drop it, or set {LOCAL_TLS_ENV}=0 "
            "to run the local cluster without TLS"
        )
    return {"security": Security.temporary()}
