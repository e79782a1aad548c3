"""The compose stack's credentials, checked before anything starts: `python -m infra.compose_check`.

compose.yaml runs this first (the one-shot `check-secrets` service, on which every other
service waits), with ddpflow.env and s3.env as its environment: a missing value, a value
still the example's placeholder, a short password, or the workers' S3 key being the S3
administrator's stops the stack with a message naming the variable and the fix. On the host,
`python -m infra.compose_check --env-file infra/docker/ddpflow.env --env-file
infra/docker/s3.env` checks the files themselves, their mode (0600) included.

Basic auth and S3 keys cross the network only over TLS: other machines reach Prefect, MLflow
and S3 only through the stack's TLS proxy, whose certificate (DDPFLOW_HTTPS_CERT) must
name the address it is published on (DDPFLOW_PUBLISH_ADDRESS, and DDPFLOW_PUBLISH_NAME when
clients use a host name), or the clients, which check it, could not connect.

No message shows a value: only names.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

# The example files' placeholder: `python -m infra.compose_secrets` replaces every occurrence.
PLACEHOLDER = "change-me"
MIN_SECRET_LENGTH = 16
FIX = "set a long random value, or write fresh files with `python -m infra.compose_secrets DIR`"

# The S3 administrator's key pair (s3.env): the compose recipe's SeaweedFS makes the bucket
# with it; no ddpflow container holds it.
S3_ADMIN_KEY_ID = "S3_ADMIN_ACCESS_KEY_ID"
S3_ADMIN_SECRET = "S3_ADMIN_SECRET_ACCESS_KEY"

# name -> whether it is a secret (length-checked) or a user name / key id (only filled in).
VARIABLES: dict[str, bool] = {
    S3_ADMIN_KEY_ID: False,
    S3_ADMIN_SECRET: True,
    "AWS_ACCESS_KEY_ID": False,
    "AWS_SECRET_ACCESS_KEY": True,
    "PREFECT_API_AUTH_STRING": True,  # USER:PASSWORD, the password part is checked
    "MLFLOW_TRACKING_USERNAME": False,
    "MLFLOW_TRACKING_PASSWORD": True,
    "MLFLOW_FLASK_SERVER_SECRET_KEY": True,
}


def _secret_part(name: str, value: str) -> str:
    return value.partition(":")[2] if name == "PREFECT_API_AUTH_STRING" else value


def problems(env: Mapping[str, str], names: Iterable[str] = VARIABLES) -> list[str]:
    """What is wrong with the stack's credentials in env, one line per variable, no value."""
    found = []
    for name in names:
        value = env.get(name, "").strip()
        if not value:
            found.append(f"{name} is not set; {FIX}")
        elif PLACEHOLDER in value.lower():
            found.append(f"{name} is still the example's placeholder ({PLACEHOLDER}...); {FIX}")
        elif name == "PREFECT_API_AUTH_STRING" and ":" not in value:
            found.append(f"{name} must be USER:PASSWORD; {FIX}")
        elif VARIABLES.get(name) and len(_secret_part(name, value)) < MIN_SECRET_LENGTH:
            found.append(f"{name} is shorter than {MIN_SECRET_LENGTH} characters; {FIX}")
    admin, worker = env.get(S3_ADMIN_KEY_ID, ""), env.get("AWS_ACCESS_KEY_ID", "")
    if admin and worker and admin.strip() == worker.strip():
        found.append(
            f"AWS_ACCESS_KEY_ID is {S3_ADMIN_KEY_ID}: the workers would hold the S3 "
            "administrator's key; give them their own (the s3 service makes it a user of the "
            "bucket only)"
        )
    return found


def cert_problems(cert: Path, hosts: Iterable[str]) -> list[str]:
    """A TLS certificate that is missing, or that does not name every one of hosts."""
    from cryptography import x509

    cert = Path(cert)
    fix = f"make it with `python -m infra.certs {cert.parent} --host ADDRESS ...`"
    if not cert.is_file():
        return [f"no TLS certificate at {cert}; {fix}"]
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    try:
        san = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = x509.SubjectAlternativeName([])
    named = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    named |= {dns.lower() for dns in san.get_values_for_type(x509.DNSName)}
    missing = [h for h in hosts if h and h.strip("[]").lower() not in named]
    if missing:
        return [f"the TLS certificate {cert} does not name {', '.join(missing)}; {fix}"]
    return []


UNSPECIFIED = ("0.0.0.0", "::", "[::]")


def published_hosts(env: Mapping[str, str]) -> list[str]:
    """The addresses clients use for the TLS proxy: DDPFLOW_PUBLISH_ADDRESS/_NAME.

    0.0.0.0 (every address) is no address a client uses: DDPFLOW_PUBLISH_NAME names it then.
    """
    names = ("DDPFLOW_PUBLISH_ADDRESS", "DDPFLOW_PUBLISH_NAME")
    hosts = [env.get(n, "").strip() for n in names]
    return [h for h in hosts if h and h not in UNSPECIFIED]


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as compose's env_file reads them (comments, blank lines, quotes)."""
    env = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def file_problems(path: Path) -> list[str]:
    """A credentials file that others on the host can read, or that is missing."""
    path = Path(path)
    if not path.is_file():
        return [f"{path} does not exist; {FIX}"]
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return [f"{path} is mode {mode:04o}, readable by others; run `chmod 600 {path}`"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.compose_check", description=__doc__)
    parser.add_argument(
        "--env-file",
        type=Path,
        action="append",
        default=[],
        help="check this file (and its mode) instead of the environment; repeatable",
    )
    args = parser.parse_args(argv)
    found: list[str] = []
    env: dict[str, str] = {}
    for path in args.env_file:
        found += file_problems(path)
        if path.is_file():
            env.update(read_env_file(path))
    found += problems(env if args.env_file else os.environ)
    if cert := os.environ.get("DDPFLOW_HTTPS_CERT"):
        if not published_hosts(os.environ):
            found.append(
                "DDPFLOW_PUBLISH_ADDRESS is every address; set DDPFLOW_PUBLISH_NAME to the "
                "host name or address the clients use (the TLS certificate must name it)"
            )
        found += cert_problems(Path(cert), published_hosts(os.environ))
    for line in found:
        print(f"compose_check: {line}", file=sys.stderr)
    if found:
        print("compose_check: refusing to start the stack", file=sys.stderr)
        return 2
    print("compose_check: credentials set, no placeholder")
    return 0


if __name__ == "__main__":
    sys.exit(main())
