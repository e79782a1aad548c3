"""What a running stack looks like on disk: `<dir>/state.json`, `<dir>/env.sh`, the summary.

Both files hold the stack's credentials, so both are written 0600 (see `infra.private`).
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.private import write_private
from infra.procs import Service

BUCKET = "ddpflow"
WORK_POOL = "ddpflow-pool"
# Service names in start order; `down` stops them in reverse.
START_ORDER = (
    "seaweedfs",
    "mlflow",
    "prefect-server",
    "dask-scheduler",
    "dask-workers",
    "prefect-worker",
)


class StackError(RuntimeError):
    """The stack cannot start, or did not stop cleanly; the message says what to do."""


@dataclass
class StackState:
    """The stack in one folder: its services (in start order), ports and client environment."""

    dir: Path
    ports: dict[str, int]
    env: dict[str, str]
    services: list[Service] = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)
    total_startup_s: float = 0.0

    @property
    def state_path(self) -> Path:
        return self.dir / "state.json"

    @property
    def env_path(self) -> Path:
        return self.dir / "env.sh"

    @property
    def log_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def secrets_dir(self) -> Path:
        return self.dir / "secrets"

    def service(self, name: str) -> Service:
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(f"no service {name!r} in the stack at {self.dir}")

    def add(self, service: Service, startup_s: float) -> None:
        """Record a started service and save at once: `down` can clean up a half-started stack."""
        self.services.append(service)
        self.startup_s[service.name] = round(startup_s, 2)
        self.save()

    def save(self) -> None:
        data: dict[str, Any] = {
            "dir": str(self.dir),
            "ports": self.ports,
            "env": self.env,
            "services": [s.to_dict() for s in self.services],
            "startup_s": self.startup_s,
            "total_startup_s": self.total_startup_s,
        }
        write_private(self.state_path, json.dumps(data, indent=2) + "\n")  # atomic too

    @classmethod
    def load(cls, stack_dir: Path) -> StackState | None:
        """The recorded stack in stack_dir, or None if there is none."""
        path = Path(stack_dir).resolve() / "state.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(
            dir=Path(data["dir"]),
            ports=data["ports"],
            env=data["env"],
            services=[Service.from_dict(s) for s in data["services"]],
            startup_s=data.get("startup_s", {}),
            total_startup_s=data.get("total_startup_s", 0.0),
        )

    def write_env_file(self) -> None:
        write_private(self.env_path, env_block(self.env) + "\n")

    def remove_files(self) -> None:
        """Forget the stack: its record, its env file and its (now useless) credentials."""
        self.state_path.unlink(missing_ok=True)
        self.env_path.unlink(missing_ok=True)
        shutil.rmtree(self.secrets_dir, ignore_errors=True)


def client_env(ports: dict[str, int]) -> dict[str, str]:
    """The environment a client (flow, test, shell) needs to use the stack."""
    return {
        "PREFECT_API_URL": f"http://127.0.0.1:{ports['prefect']}/api",
        # Where Prefect's "View at" links and ddpflow's links to a flow run point: the
        # server's default UI (v2, under /v2 in Prefect 3.8), which asks for the auth string
        # and then opens the linked page. Prefect's default, the API URL without /api, is
        # the v1 UI, which shows "Page not found" for a link opened before logging in.
        "PREFECT_UI_URL": f"http://127.0.0.1:{ports['prefect']}/v2",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{ports['mlflow']}",
        "DDPFLOW_ARTIFACT_ROOT": f"s3://{BUCKET}/artifacts",
        "DDPFLOW_DASK_ADDRESS": f"tls://127.0.0.1:{ports['dask']}",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{ports['s3']}",
        "AWS_DEFAULT_REGION": "us-east-1",
        # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY: the stack's S3 user (infra.auth).
    }


# Printed as a placeholder: a terminal's scroll-back or a CI log must not keep them.
SECRET_KEYS = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY")


def env_block(env: dict[str, str], hide_secrets: bool = False) -> str:
    """`export` lines for a shell, with a note on what the credentials are."""
    lines = [
        "# ddpflow local stack: source this file to point flows, tests and CLIs at it.",
        "# The AWS key is the stack's own SeaweedFS user, limited to its bucket; it works on",
        "# no real AWS account. It and the Prefect, MLflow and Dask credentials are new at",
        "# every `up`.",
    ]
    for key, value in env.items():
        shown = "<in env.sh>" if hide_secrets and key in SECRET_KEYS else shlex.quote(value)
        lines.append(f"export {key}={shown}")
    return "\n".join(lines)


def summary(state: StackState) -> str:
    """What `up` prints: services, URLs, start-up times, the env block, how to stop."""
    rows = [f"ddpflow local stack is up in {state.total_startup_s:.1f} s ({state.dir})", ""]
    rows.append(f"  {'service':<16}{'pid':>8}  {'started in':>10}  url")
    for service in state.services:
        took = f"{state.startup_s.get(service.name, 0.0):.1f} s"
        rows.append(f"  {service.name:<16}{service.pid:>8}  {took:>10}  {service.url}")
    prefect_ui = state.env["PREFECT_API_URL"].removesuffix("/api")
    rows += [
        "",
        f"  Prefect UI       {prefect_ui}  (log in with $PREFECT_API_AUTH_STRING from env.sh)",
        f"  MLflow UI        {state.env['MLFLOW_TRACKING_URI']}  (user "
        f"{state.env.get('MLFLOW_TRACKING_USERNAME', '')}, password $MLFLOW_TRACKING_PASSWORD)",
        f"  S3 (SeaweedFS)   {state.env['AWS_ENDPOINT_URL_S3']}  bucket s3://{BUCKET}",
        f"  work pool        {WORK_POOL}",
        f"  logs             {state.log_dir}/<service>.log",
        "",
        f"The environment to use it (credentials not shown): source {state.env_path}",
        "",
        env_block(state.env, hide_secrets=True),
        "",
        f"Stop it with: .venv/bin/python -m infra.stack down --dir {state.dir}",
    ]
    return "\n".join(rows)
