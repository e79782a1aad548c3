"""TLS certificates for a Dask cluster: `python -m infra.certs DIR`.

Writes DIR/ca.pem (the cluster's own CA), DIR/cert.pem and DIR/key.pem (a certificate that CA
signed, for the scheduler, the workers and the clients alike), each mode 0600, DIR 0700.
Dask's TLS is mutual: every connection must present a certificate signed by the CA in
ca.pem, so only holders of key.pem can submit work. The CA's own key is never written:
nobody can sign another certificate, and rotating means running the command again and
handing the new files to every process. Dask does not check host names (certificates are
for the cluster, not for a DNS name), so the same files work for any address.

`--host NAME_OR_IP` (repeatable) also names the hosts the certificate serves (its subject
alternative names), for HTTPS clients that check them: compose's TLS proxy
(`python -m infra.certs infra/docker/https --host 127.0.0.1 --host <published address>`).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.private import private_dir, write_private

DEFAULT_DAYS = 365
# Dask's configuration as environment variables: every Dask process and client reads them at
# import, so a flow needs nothing but these to connect to a tls:// scheduler.
TLS_ENV = "DASK_DISTRIBUTED__COMM__TLS__"
REQUIRE_ENCRYPTION_ENV = "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"
ROLES = ("CLIENT", "SCHEDULER", "WORKER")


@dataclass(frozen=True)
class TlsFiles:
    """Where a cluster's CA certificate, certificate and key are."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, folder: Path) -> TlsFiles:
        folder = Path(folder)
        return cls(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")

    def dask_env(self, roles: tuple[str, ...] = ROLES) -> dict[str, str]:
        """Dask settings that make `roles` use these files and refuse unencrypted links."""
        env = {f"{TLS_ENV}CA_FILE": str(self.ca), REQUIRE_ENCRYPTION_ENV: "True"}
        for role in roles:
            env[f"{TLS_ENV}{role}__CERT"] = str(self.cert)
            env[f"{TLS_ENV}{role}__KEY"] = str(self.key)
        return env

    def cli_args(self) -> list[str]:
        """`dask scheduler` / `dask worker` flags for these files."""
        flags = ("--tls-ca-file", "--tls-cert", "--tls-key")
        return [
            arg
            for flag, path in zip(flags, (self.ca, self.cert, self.key), strict=True)
            for arg in (flag, str(path))
        ]


def security_from_env(env: Mapping[str, str]):  # -> distributed.Security | None
    """A client Security from TLS_ENV settings in env (a process that did not import them)."""
    if f"{TLS_ENV}CA_FILE" not in env:
        return None
    from distributed.security import Security

    return Security(
        require_encryption=True,
        tls_ca_file=env[f"{TLS_ENV}CA_FILE"],
        tls_client_cert=env[f"{TLS_ENV}CLIENT__CERT"],
        tls_client_key=env[f"{TLS_ENV}CLIENT__KEY"],
    )


def make_certs(
    folder: Path,
    days: int = DEFAULT_DAYS,
    name: str = "ddpflow-dask",
    hosts: Sequence[str] = (),
) -> TlsFiles:
    """A throwaway CA and one certificate it signed (for `hosts`), written 0600 into folder."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    uses = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    leaf = (
        _builder(leaf_name, ca_name, key.public_key(), now, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(uses), critical=False)
    )
    if hosts:
        leaf = leaf.add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)
    leaf = leaf.sign(ca_key, hashes.SHA256())
    files = TlsFiles.in_dir(private_dir(folder))
    pem = serialization.Encoding.PEM
    write_private(files.ca, ca.public_bytes(pem))
    write_private(files.cert, leaf.public_bytes(pem))
    key_format = serialization.PrivateFormat.PKCS8
    write_private(files.key, key.private_bytes(pem, key_format, serialization.NoEncryption()))
    return files


def _san(hosts: Sequence[str]) -> list:
    """IP addresses as IP entries (what clients match an IP URL against), others as DNS names."""
    from cryptography import x509

    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _builder(subject, issuer, public_key, now: datetime.datetime, days: int):
    from cryptography import x509

    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _usage(cert_sign: bool):
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=not cert_sign,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.certs", description=__doc__)
    parser.add_argument("dir", type=Path, help="folder for ca.pem, cert.pem, key.pem")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="a host name or IP address the certificate serves (HTTPS); repeatable",
    )
    args = parser.parse_args(argv)
    if args.days < 1:
        parser.error(f"--days must be at least 1, got {args.days}")
    files = make_certs(args.dir, args.days, hosts=args.host)
    print(f"wrote {files.ca}, {files.cert}, {files.key} (mode 0600), valid {args.days} days")
    print("Dask settings that use them (every scheduler, worker and client):")
    for name, value in files.dask_env().items():
        print(f"export {name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
