"""Per-run TLS credentials for the jobqueue clusters a flow starts (Slurm, PBS, ...).

The scheduler runs in the flow's process and the workers are batch jobs that connect to it
from the compute nodes. On plain tcp:// anyone who reaches its port runs code as the flow's
user, with its AWS, MLflow and Prefect credentials (`Client(address).run_on_scheduler(...)`),
and a `dask worker` anyone starts joins the cluster and is taken as a DDP rank. So, as for the
local cluster (ddpflow.cluster.local_tls), each cluster gets a self-signed certificate of its
own (Dask's `Security.temporary()`, one key for every role) and every listener requires it.

The scheduler and the flow's client hold it in memory. The jobs need it as files in a folder
the compute nodes share: dask-jobqueue's own way (`security=True`) writes them with
NamedTemporaryFile straight into `shared_temp_directory` (the working directory unless set)
and deletes them only when the cluster object is garbage collected. Here they go into a fresh
0700 folder made for the cluster inside that shared folder, each file 0600 (only the user the
jobs run as reads them), and the folder is removed when the cluster closes. The job script
names the files on its `dask worker` line (`--tls-key PATH`): paths only, never key material,
so neither `ps` nor a copy of the script shows a credential.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import dask
from distributed.deploy import Cluster
from distributed.security import Security

from ddpflow.config import CLUSTER_OPTIONS_ENV, REMOTE_TLS_ENV, ConfigError

FOLDER_PREFIX = ".ddpflow-dask-tls-"


class CredentialFolder:
    """A 0700 folder of 0600 files, made for one cluster and removed with it."""

    def __init__(self, base: Path) -> None:
        # mkdtemp makes the folder 0700 whatever the umask, under a name nobody can guess.
        self.path = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=base))

    def write(self, name: str, text: str) -> str:
        """Write `text` to a new file only this user can read; its absolute path."""
        path = self.path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text)
        return str(path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def jobqueue_security(
    tls: bool, options: dict[str, Any], config_name: str
) -> CredentialFolder | None:
    """Give the jobqueue cluster's `options` (in place) TLS with credentials made for it.

    Returns the folder that holds the jobs' copies (remove it when the cluster closes), or
    None with `tls` off, when the options are left as they are. Options that ask for another
    security or a non-TLS protocol contradict the setting and are refused before anything
    starts; `security: true` (dask-jobqueue's own per-run certificates) asks for what this
    does anyway and is taken. `config_name` is the dask-jobqueue class's (slurm, pbs, ...).
    """
    if not tls:
        return None
    _refuse_contradictions(options)
    options.pop("security", None)
    credentials = Security.temporary()
    folder = CredentialFolder(_shared_base(options, config_name))
    try:
        ca = folder.write("ca.pem", credentials.tls_ca_file)
        cert = folder.write("cert.pem", credentials.tls_worker_cert)
        key = folder.write("key.pem", credentials.tls_worker_key)
    except BaseException:
        folder.remove()
        raise
    # Paths, not PEM text: dask-jobqueue then writes no files of its own and puts these
    # paths on the jobs' command line. The same certificate and key serve every role.
    roles = {f"tls_{role}_{part}": path for role in ("client", "scheduler", "worker")
             for part, path in (("cert", cert), ("key", key))}  # fmt: skip
    options["security"] = Security(require_encryption=True, tls_ca_file=ca, **roles)
    options["protocol"] = "tls://"
    return folder


def _refuse_contradictions(options: Mapping[str, Any]) -> None:
    scheduler = options.get("scheduler_options") or {}
    conflicts = []
    # `security: true` asks dask-jobqueue for per-run certificates: what this does anyway.
    if options.get("security", True) is not True:
        conflicts.append(f"security={options['security']!r}")
    if "security" in scheduler:  # it would replace the cluster's own for the scheduler
        conflicts.append(f"scheduler_options.security={scheduler['security']!r}")
    for where, given in (("", options), ("scheduler_options.", scheduler)):
        protocol = given.get("protocol")
        if protocol and str(protocol).removesuffix("://") != "tls":
            conflicts.append(f"{where}protocol={protocol!r}")
    if conflicts:
        raise ConfigError(
            f"{CLUSTER_OPTIONS_ENV} sets {', '.join(conflicts)}, but the jobqueue cluster "
            "already uses TLS with credentials made for each run; drop it, or set "
            f"{REMOTE_TLS_ENV}=0 to run the jobqueue cluster on plain tcp://"
        )


def _shared_base(options: Mapping[str, Any], config_name: str) -> Path:
    """Where the credentials folder goes: a folder the compute nodes see at the same path.
    dask-jobqueue's `shared_temp_directory` (option or Dask config) when set, else the home
    folder, which batch systems share with their nodes."""
    raw = options.get("shared_temp_directory") or dask.config.get(
        f"jobqueue.{config_name}.shared-temp-directory", None
    )
    base = Path(os.path.expandvars(os.path.expanduser(str(raw or "~"))))
    if not base.is_dir():
        raise ConfigError(
            f"{CLUSTER_OPTIONS_ENV}: shared_temp_directory={str(raw)!r} is not a folder; the "
            "jobqueue cluster's TLS credentials go into a folder made there, which the "
            "worker jobs read: set it to a folder the compute nodes share"
        )
    return base


@functools.cache
def removing_folder_on_close(cls: type[Cluster]) -> Callable[..., Cluster]:
    """`cls` taking a `tls_folder` that its instances remove when they close (also at
    interpreter exit, where distributed closes every cluster still open)."""

    class Removing(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, tls_folder: CredentialFolder, **kwargs: Any) -> None:
            self.tls_folder = tls_folder  # first: a failed start closes the cluster
            super().__init__(*args, **kwargs)

        async def _close(self) -> None:
            try:
                await super()._close()
            finally:
                self.tls_folder.remove()

    # The jobqueue class's own name: messages and checks that name the class still read right.
    Removing.__name__ = Removing.__qualname__ = cls.__name__
    return Removing
