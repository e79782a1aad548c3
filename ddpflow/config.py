"""Typed settings read once from the environment (the configuration contract in DESIGN.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ARTIFACT_ROOT_ENV = "DDPFLOW_ARTIFACT_ROOT"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DASK_ADDRESS_ENV = "DDPFLOW_DASK_ADDRESS"
DASK_WORKERS_ENV = "DDPFLOW_DASK_WORKERS"
DEFAULT_NUM_WORKERS = 2


class ConfigError(ValueError):
    """A setting has a value ddpflow cannot use; the message names the setting and the fix."""


@dataclass(frozen=True)
class Settings:
    """Where ddpflow keeps things and which cluster it uses."""

    artifact_root: str
    tracking_uri: str
    dask_address: str | None
    num_dask_workers: int
    project_dir: Path

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
        return cls(
            artifact_root=normalise_root(artifact_root, base=project_dir),
            tracking_uri=tracking_uri,
            dask_address=env.get(DASK_ADDRESS_ENV) or None,
            num_dask_workers=_parse_workers(env.get(DASK_WORKERS_ENV)),
            project_dir=project_dir,
        )


def normalise_root(root: str, base: Path | None = None) -> str:
    """Make a local artifact root absolute (Dask workers may run in another directory).

    A relative local root is taken relative to `base` (the project folder; default: cwd).
    """
    root = root.strip()
    if not root:
        raise ConfigError(f"{ARTIFACT_ROOT_ENV} is empty; set a local folder or s3://bucket/prefix")
    if "://" in root and not root.startswith("file://"):
        return root.rstrip("/")
    path = Path(root.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return str(path.resolve())


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
