"""Typed settings read once from the environment: the variables every flow, test and doc uses."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ARTIFACT_ROOT_ENV = "DDPFLOW_ARTIFACT_ROOT"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DASK_ADDRESS_ENV = "DDPFLOW_DASK_ADDRESS"
DASK_WORKERS_ENV = "DDPFLOW_DASK_WORKERS"
CLUSTER_ENV = "DDPFLOW_CLUSTER"
CLUSTER_OPTIONS_ENV = "DDPFLOW_CLUSTER_OPTIONS"
RANK_RESOURCES_ENV = "DDPFLOW_RANK_RESOURCES"
# TLS with per-run credentials for the clusters ddpflow starts on this machine (local, cuda):
# on by default; "0" turns it off (ddpflow.cluster.local_tls says why it is on).
LOCAL_TLS_ENV = "DDPFLOW_LOCAL_CLUSTER_TLS"
# The same for the clusters a flow starts whose workers run elsewhere: jobqueue gets per-run
# TLS, kubernetes (whose KubeCluster cannot use TLS) is refused; "0" starts either on plain
# tcp:// (ddpflow.cluster.jobqueue_tls and ddpflow.cluster.tls say why).
REMOTE_TLS_ENV = "DDPFLOW_REMOTE_CLUSTER_TLS"
# "1" gives the dashboards of the clusters ddpflow starts Dask's /info pages back
# (ddpflow.cluster.dashboard says why they are off).
DASHBOARD_INFO_ENV = "DDPFLOW_DASHBOARD_INFO"
HEAL_TIMEOUT_ENV = "DDPFLOW_HEAL_TIMEOUT_S"
DEFAULT_HEAL_TIMEOUT_S = 120.0
SETTLE_ENV = "DDPFLOW_GROW_SETTLE_S"
# How long a worker that joined must stay before an elastic group grows onto it: Ray Train's
# elastic resize monitor looks once a minute; a node that fails its start goes within that.
DEFAULT_SETTLE_S = 60.0
STORE_OUTAGE_ENV = "DDPFLOW_STORE_OUTAGE_S"
# A checkpoint write retries for this long before the run fails: a 1-minute store outage
# (a restart, a network blip) with room to spare.
DEFAULT_STORE_OUTAGE_S = 300.0
MAX_LOAD_ENV = "DDPFLOW_MAX_LOAD_MB"
# The largest tensor file ddpflow loads whole (a checkpoint, weights=, a formatted split):
# a ResNet-50 checkpoint with its Adam state is about 300 MB and the formatted splits are
# held in memory anyway; past this a file is taken for a mistake (or /dev/zero's kin).
DEFAULT_MAX_LOAD_MB = 8192.0
DEFAULT_NUM_WORKERS = 2
# Which Dask cluster the flows run on (ddpflow.cluster.build builds each one).
CLUSTER_KINDS = ("local", "address", "cuda", "jobqueue", "kubernetes")


class ConfigError(ValueError):
    """A setting has a value ddpflow cannot use; the message names the setting and the fix."""


@dataclass(frozen=True)
class LaunchSettings:
    """What the tasks that launch ranks take from the settings. The flow reads the settings
    once and passes this down, so no task reads the environment again."""

    heal_timeout_s: float = DEFAULT_HEAL_TIMEOUT_S
    rank_resources: dict[str, float] | None = None  # e.g. {"GPU": 1}: GPU workers only
    # How long a worker that joined must stay before a group with max_workers grows onto it.
    settle_s: float = DEFAULT_SETTLE_S


@dataclass(frozen=True)
class Settings:
    """Where ddpflow keeps things and which cluster it uses."""

    artifact_root: str
    tracking_uri: str
    dask_address: str | None
    num_dask_workers: int
    project_dir: Path
    # Added for the cluster backends; defaults keep the laptop behaviour.
    cluster_kind: str = "local"
    cluster_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    rank_resources: Mapping[str, float] | None = field(default=None, hash=False)
    # How long a restart waits for lost workers to come back before it goes on with fewer
    # (min_workers) or gives up.
    heal_timeout_s: float = DEFAULT_HEAL_TIMEOUT_S
    # How long a worker that joined must stay before an elastic group grows onto it.
    settle_s: float = DEFAULT_SETTLE_S
    # How long a checkpoint write waits out an unreachable artifact store (store_outage_s()).
    store_outage_s: float = DEFAULT_STORE_OUTAGE_S
    # The cap on a tensor file read whole (max_load_bytes()).
    max_load_bytes: int = int(DEFAULT_MAX_LOAD_MB * 2**20)
    # Whether the local and cuda clusters ddpflow starts use TLS (DDPFLOW_LOCAL_CLUSTER_TLS).
    local_cluster_tls: bool = True
    # Whether the jobqueue and kubernetes clusters a flow starts use TLS
    # (DDPFLOW_REMOTE_CLUSTER_TLS; kubernetes cannot, so it is refused unless this is off).
    remote_cluster_tls: bool = True

    @property
    def mlflow_artifacts(self) -> str:
        """Where MLflow's copies (checkpoints, models) of a new experiment in a SQLite store
        go: inside the artifact root, so that one setting says where a run's files land."""
        return self.artifact_root.rstrip("/") + "/mlflow"

    @property
    def launch(self) -> LaunchSettings:
        resources = dict(self.rank_resources) if self.rank_resources else None
        return LaunchSettings(
            heal_timeout_s=self.heal_timeout_s, rank_resources=resources, settle_s=self.settle_s
        )

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, project_dir: Path | None = None
    ) -> Settings:
        """Read the contract's variables; unset ones fall back to the embedded defaults.

        The project folder is the working directory: the README's commands, `prefect deploy`
        pull steps and the process worker all run from the repository root.
        """
        env = os.environ if env is None else env
        project_dir = (project_dir or Path.cwd()).resolve()
        artifact_root = env.get(ARTIFACT_ROOT_ENV) or str(project_dir / "artifacts")
        tracking_uri = env.get(TRACKING_URI_ENV) or f"sqlite:///{project_dir / 'mlflow.db'}"
        dask_address = (env.get(DASK_ADDRESS_ENV) or "").strip() or None
        return cls(
            artifact_root=normalise_root(artifact_root, base=project_dir),
            tracking_uri=tracking_uri,
            dask_address=dask_address,
            num_dask_workers=_parse_workers(env.get(DASK_WORKERS_ENV)),
            project_dir=project_dir,
            cluster_kind=_parse_cluster_kind(env.get(CLUSTER_ENV), dask_address),
            cluster_options=_parse_json_object(CLUSTER_OPTIONS_ENV, env.get(CLUSTER_OPTIONS_ENV)),
            rank_resources=_parse_resources(env.get(RANK_RESOURCES_ENV)),
            heal_timeout_s=_parse_seconds(
                HEAL_TIMEOUT_ENV, env.get(HEAL_TIMEOUT_ENV), DEFAULT_HEAL_TIMEOUT_S
            ),
            settle_s=_parse_seconds(SETTLE_ENV, env.get(SETTLE_ENV), DEFAULT_SETTLE_S),
            store_outage_s=store_outage_s(env),
            max_load_bytes=max_load_bytes(env),
            local_cluster_tls=_parse_switch(LOCAL_TLS_ENV, env.get(LOCAL_TLS_ENV), default=True),
            remote_cluster_tls=_parse_switch(REMOTE_TLS_ENV, env.get(REMOTE_TLS_ENV), default=True),
        )


def store_outage_s(env: Mapping[str, str] | None = None) -> float:
    """DDPFLOW_STORE_OUTAGE_S, alone: rank 0 reads it where it writes a checkpoint (its Dask
    worker, whose environment a LocalCluster copies from the flow's), without the other
    settings; the flow reads it with them at its start, so a bad value fails there first."""
    env = os.environ if env is None else env
    return _parse_seconds(STORE_OUTAGE_ENV, env.get(STORE_OUTAGE_ENV), DEFAULT_STORE_OUTAGE_S)


def max_load_bytes(env: Mapping[str, str] | None = None) -> int:
    """DDPFLOW_MAX_LOAD_MB in bytes, alone: read where a file is loaded (a rank's or a
    task's Dask worker, whose environment a LocalCluster copies from the flow's); the flow
    reads it with the other settings at its start, so a bad value fails there first."""
    env = os.environ if env is None else env
    raw = env.get(MAX_LOAD_ENV)
    if raw is None or raw.strip() == "":
        return int(DEFAULT_MAX_LOAD_MB * 2**20)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 1 <= value < 2**30:
        raise ConfigError(
            f"{MAX_LOAD_ENV}={raw!r} is not a size in MiB from 1 up; e.g. {DEFAULT_MAX_LOAD_MB:g}"
        )
    return int(value * 2**20)


def normalise_root(root: str, base: Path | None = None) -> str:
    """Make a local artifact root absolute (Dask workers may run in another directory).

    A relative local root is taken relative to `base` (the project folder; default: cwd).
    """
    root = root.strip()
    if not root:
        raise ConfigError(f"{ARTIFACT_ROOT_ENV} is empty; set a local folder or s3://bucket/prefix")
    if "://" in root and not root.startswith("file://"):
        _refuse_credentials_in_root(root)
        return root.rstrip("/")
    path = Path(root.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return str(path.resolve())


def _refuse_credentials_in_root(root: str) -> None:
    """Every checkpoint URI is the root plus a path, and MLflow records it in tags (and shows
    it in every summary): a credential in the root would be stored with each one. Neither
    the root nor any part of it is quoted here."""
    try:
        parts = urlsplit(root)
    except ValueError:
        raise ConfigError(
            f"{ARTIFACT_ROOT_ENV} is not a valid URI; set a local folder or s3://bucket/prefix"
        ) from None
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise ConfigError(
            f"{ARTIFACT_ROOT_ENV} carries user info or a query string, which would be written "
            "into every checkpoint URI MLflow records; set it without them (s3://bucket/prefix) "
            "and put the credentials in the environment: AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
        )


def _parse_workers(raw: str | None) -> int:
    if raw is None or raw.strip() == "":
        return DEFAULT_NUM_WORKERS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{DASK_WORKERS_ENV}={raw!r} is not a positive integer; set it to the number of "
            "local Dask worker processes, e.g. 2"
        )
    return value


def _parse_seconds(name: str, raw: str | None, default: float) -> float:
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={raw!r} is not a positive number of seconds; e.g. {default:g}")
    return value


_SWITCH = {"1": True, "true": True, "yes": True, "on": True}
_SWITCH |= {"0": False, "false": False, "no": False, "off": False}


def _parse_switch(name: str, raw: str | None, default: bool) -> bool:
    if raw is None or raw.strip() == "":
        return default
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise ConfigError(f"{name}={raw!r} is not on or off; set it to 1 or 0")
    return value


def _parse_cluster_kind(raw: str | None, dask_address: str | None) -> str:
    """`address` when only DDPFLOW_DASK_ADDRESS is set, `local` when nothing is."""
    kind = (raw or "").strip().lower() or ("address" if dask_address else "local")
    if kind not in CLUSTER_KINDS:
        raise ConfigError(
            f"{CLUSTER_ENV}={raw!r} is not a cluster kind; use one of {', '.join(CLUSTER_KINDS)}"
        )
    if kind == "address" and not dask_address:
        raise ConfigError(
            f"{CLUSTER_ENV}=address needs {DASK_ADDRESS_ENV}, the scheduler to connect to "
            "(e.g. tcp://scheduler:8786)"
        )
    if kind != "address" and dask_address:
        raise ConfigError(
            f"{CLUSTER_ENV}={kind} starts its own cluster but {DASK_ADDRESS_ENV}={dask_address!r} "
            f"points at an existing one; unset one of them"
        )
    return kind


def _parse_json_object(name: str, raw: str | None) -> dict[str, Any]:
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f'{name} is not valid JSON ({error}): {raw!r}; set a JSON object such as {{"a": 1}}'
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f'{name} must be a JSON object such as {{"n_workers": 2}}, got {raw!r}')
    return value


def _parse_resources(raw: str | None) -> dict[str, float] | None:
    """Dask worker resources every DDP rank needs, e.g. {"GPU": 1}; unset means none."""
    value = _parse_json_object(RANK_RESOURCES_ENV, raw)
    bad = {k: v for k, v in value.items() if isinstance(v, bool) or not _positive(v)}
    if bad:
        raise ConfigError(
            f'{RANK_RESOURCES_ENV} amounts must be positive numbers (e.g. {{"GPU": 1}}), got {bad}'
        )
    return {k: float(v) for k, v in value.items()} or None


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0
