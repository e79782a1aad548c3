"""The local stack's credentials, made fresh at every `up` and kept in `<dir>/secrets` (0700).

What each protects (every service also listens on 127.0.0.1 only):
- Dask: mutual TLS. The scheduler and workers accept only connections that present a
  certificate signed by the stack's CA, so nobody without `secrets/tls/key.pem` can submit
  pickled functions to the workers (which hold the S3 keys).
- Prefect: HTTP basic auth on the API (`PREFECT_SERVER_API_AUTH_STRING` on the server,
  `PREFECT_API_AUTH_STRING` on clients), so nobody else can create flow runs that the
  process worker would execute.
- MLflow: the `basic-auth` app; clients log in with MLFLOW_TRACKING_USERNAME/PASSWORD, so
  nobody else can change runs, the registry or the `champion` alias.
- S3 (SeaweedFS): two S3 keys. The administrator's creates the bucket at `up` and is
  written nowhere else (`secrets/seaweedfs/identities.json`); the stack's user's key, the
  AWS_* pair in `env.sh`, may read, write and list that bucket and nothing more. The inner
  ports of SeaweedFS want a certificate of their own (infra.seaweedfs.config).
The servers' health endpoints stay open: they say "up" and nothing else.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from infra.certs import TlsFiles, make_certs
from infra.private import private_dir, write_private
from infra.seaweedfs.config import Identity, S3Key

PREFECT_USER = "ddpflow"
MLFLOW_ADMIN = "ddpflow"
S3_ADMIN = "stack-admin"
S3_USER = "ddpflow"
# MLflow's basic-auth app checks the password against its scrypt hash on every request:
# 0.13 CPU-seconds each on this 2-core machine (werkzeug's scrypt:32768:8:1), so a training
# that logs metrics and checkpoints kept the stack's server on a core. Its opt-in cache
# keeps a successful check for this long, keyed by an HMAC of the password under a key
# made at each server start (python -m bench.mlflow_auth measures both). The one server
# worker drops a user's entries at once when the user API changes or deletes them; a change
# made in the auth DB behind the server's back counts after this many seconds at most.
MLFLOW_AUTH_CACHE_TTL_S = 60


def _token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class StackSecrets:
    """Credentials and certificate paths of one stack."""

    dir: Path
    prefect_auth_string: str
    mlflow_password: str
    flask_secret_key: str
    tls: TlsFiles
    s3_admin: S3Key
    s3_user: S3Key

    @classmethod
    def create(cls, folder: Path) -> StackSecrets:
        """New credentials, a new CA and certificate, and MLflow's auth config, in folder."""
        folder = private_dir(folder, fresh=True)  # an old auth DB would keep an old password
        made = cls(
            dir=folder,
            prefect_auth_string=f"{PREFECT_USER}:{_token()}",
            mlflow_password=_token(),
            flask_secret_key=_token(),
            tls=make_certs(folder / "tls"),
            s3_admin=S3Key.new(),
            s3_user=S3Key.new(),
        )
        write_private(made.mlflow_auth_config, made._mlflow_ini())
        return made

    @property
    def seaweedfs_dir(self) -> Path:
        """SeaweedFS's configuration: identities, security.toml, its inner certificates."""
        return self.dir / "seaweedfs"

    def s3_identities(self, bucket: str) -> list[Identity]:
        """The administrator, and the stack's user limited to `bucket`."""
        return [Identity(S3_ADMIN, self.s3_admin), Identity(S3_USER, self.s3_user, bucket)]

    @property
    def mlflow_auth_config(self) -> Path:
        return self.dir / "mlflow-auth.ini"

    def _mlflow_ini(self) -> str:
        # The auth DB holds password hashes: it lives in the private folder too.
        # NO_PERMISSIONS: a user added later sees nothing until granted.
        return "\n".join([
            "[mlflow]",
            "default_permission = NO_PERMISSIONS",
            f"database_uri = sqlite:///{self.dir / 'mlflow-auth.db'}",
            f"admin_username = {MLFLOW_ADMIN}",
            f"admin_password = {self.mlflow_password}",
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
            f"auth_cache_ttl_seconds = {MLFLOW_AUTH_CACHE_TTL_S}",
            "",
        ])  # fmt: skip

    def client_env(self) -> dict[str, str]:
        """What a flow, a test or a shell needs to use the stack's servers."""
        return {
            "PREFECT_API_AUTH_STRING": self.prefect_auth_string,
            "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN,
            "MLFLOW_TRACKING_PASSWORD": self.mlflow_password,
            **self.s3_user.env(),
            **self.tls.dask_env(("CLIENT",)),
        }

    def mlflow_server_env(self) -> dict[str, str]:
        return {
            "MLFLOW_AUTH_CONFIG_PATH": str(self.mlflow_auth_config),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": self.flask_secret_key,
        }
