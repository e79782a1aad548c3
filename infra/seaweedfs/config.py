"""What a SeaweedFS server is told: who may use its S3 gateway, and how its parts trust each other.

`weed server` runs four services in one process: a master, a volume server, a filer and the
S3 gateway. Only the gateway checks S3 signatures; the other three answer HTTP and gRPC of
their own, which by default let anyone who reaches them read, write or delete any object
(`/col/delete` on the master drops a bucket's volumes, the filer serves every file). So the
server is told, in its security.toml:
- mutual TLS on every inner HTTP and gRPC port (master, volume, filer, gateway), with a CA
  and certificate made for this server alone: a request without that certificate is refused
  before any route runs;
- JWT signing keys for reads and writes on the volume server and the filer, so even a holder
  of the certificate cannot read or write a file the master or the gateway did not sign for.
Left open: the gateway's `/healthz` and `/status`, which answer 200 with an empty body.

The S3 identities (identities.json): an administrator, who creates buckets, and users that
may read, write, list and tag one bucket each, and nothing else.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.certs import TlsFiles, make_certs
from infra.private import private_dir, write_private

ADMIN_ACTIONS = ("Admin", "Read", "Write", "List", "Tagging")
BUCKET_ACTIONS = ("Read", "Write", "List", "Tagging")
# The sections of security.toml that take a server certificate: every inner service.
TLS_SERVICES = ("master", "volume", "filer", "s3")


@dataclass(frozen=True)
class S3Key:
    """An S3 access key pair, as the AWS_* variables carry it."""

    access_key_id: str
    secret_access_key: str

    @classmethod
    def new(cls) -> S3Key:
        return cls(f"DDPF{secrets.token_hex(8).upper()}", secrets.token_urlsafe(30))

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
        }


@dataclass(frozen=True)
class Identity:
    """One S3 identity: an administrator when `bucket` is None, else a user of that bucket."""

    name: str
    key: S3Key
    bucket: str | None = None

    @property
    def actions(self) -> list[str]:
        if self.bucket is None:
            return list(ADMIN_ACTIONS)
        return [f"{action}:{self.bucket}" for action in BUCKET_ACTIONS]

    def to_json(self) -> dict:
        key = {"accessKey": self.key.access_key_id, "secretKey": self.key.secret_access_key}
        return {"name": self.name, "credentials": [key], "actions": self.actions}


@dataclass(frozen=True)
class WeedConfig:
    """A server's configuration folder (0700): identities.json, security.toml, tls/."""

    dir: Path
    tls: TlsFiles

    @property
    def identities(self) -> Path:
        return self.dir / "identities.json"

    @property
    def security(self) -> Path:
        # `weed` reads ./security.toml first: the server runs with this folder as its cwd.
        return self.dir / "security.toml"


def write_config(folder: Path, identities: Sequence[Identity]) -> WeedConfig:
    """A fresh configuration in folder: the identities, new JWT keys, a new CA and certificate."""
    if not any(identity.bucket is None for identity in identities):
        raise ValueError("a SeaweedFS server needs an administrator identity (bucket=None)")
    folder = private_dir(folder, fresh=True)
    # The inner services dial each other at 127.0.0.1, which the HTTPS clients check.
    tls = make_certs(folder / "tls", name="ddpflow-seaweedfs", hosts=("127.0.0.1", "localhost"))
    config = WeedConfig(folder, tls)
    document = {"identities": [identity.to_json() for identity in identities]}
    write_private(config.identities, json.dumps(document, indent=2) + "\n")
    write_private(config.security, security_toml(tls))
    return config


def security_toml(tls: TlsFiles) -> str:
    """security.toml: JWT keys for every inner read and write, mutual TLS on every inner port."""
    lines = []
    for section in (
        "jwt.signing",
        "jwt.signing.read",
        "jwt.filer_signing",
        "jwt.filer_signing.read",
    ):
        # At least 16 bytes: the filer's key also signs the gateway's STS tokens.
        lines += [f"[{section}]", f'key = "{secrets.token_urlsafe(32)}"', ""]
    # No UI and no directory listing on the inner HTTP ports, whoever holds the certificate.
    lines += ["[access]", "ui = false", "", "[filer.expose_directory_metadata]", "enabled = false"]
    lines += ["", "[grpc]", f'ca = "{tls.ca}"', ""]
    pair = [f'cert = "{tls.cert}"', f'key = "{tls.key}"']
    for service in (*TLS_SERVICES, "client"):
        lines += [f"[grpc.{service}]", *pair, ""]
    lines += ["[https.client]", "enabled = true", *pair, f'ca = "{tls.ca}"', ""]
    for service in TLS_SERVICES[:3]:  # the gateway's own port speaks S3 over plain HTTP
        lines += [f"[https.{service}]", *pair, f'ca = "{tls.ca}"', ""]
    return "\n".join(lines)
