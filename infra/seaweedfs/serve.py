"""The compose recipe's S3 server: `python -m infra.seaweedfs.serve`, run in the project's image.

    python -m infra.seaweedfs.serve --port 9000 --data /data --config /run/ddpflow/s3 \\
        --bucket ddpflow

Two S3 identities, whose keys come from the environment (compose's env_file) and nowhere else:
- the administrator, S3_ADMIN_ACCESS_KEY_ID / S3_ADMIN_SECRET_ACCESS_KEY (s3.env), which
  creates the bucket;
- the ddpflow workers' user, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (ddpflow.env), which
  may read, write, list and tag that bucket and nothing else.

It writes the server's configuration (identities, JWT keys, the inner services' CA and
certificate: infra.seaweedfs.config) into a fresh private folder, starts `weed server` with
every inner port on 127.0.0.1 and only the S3 gateway on --bind, waits for the gateway, makes
the bucket with the administrator's key, and then writes `<config>/ready`, the file the
compose healthcheck looks for. It then waits on weed: SIGTERM or SIGINT is passed on, with
SIGKILL after STOP_WAIT_S (weed 4.48 does not exit on SIGTERM for minutes), and the exit
status is 0 after such a stop, else weed's own (2: a key is missing or shared).

The keys reach weed only through identities.json (mode 0600): not its argv, which `ps` shows,
nor its environment, nor any log line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from infra.procs import Service, ServiceError
from infra.seaweedfs.config import Identity, S3Key
from infra.seaweedfs.server import (
    LOOPBACK,
    STOP_WAIT_S,
    grpc_socket_paths,
    prepare,
    wait_for_buckets,
)

ADMIN_KEY = ("S3_ADMIN_ACCESS_KEY_ID", "S3_ADMIN_SECRET_ACCESS_KEY")
WORKER_KEY = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# weed's own environment: what a program needs to run, no credential of the container's.
WEED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")
READY = "ready"


class ConfigError(ValueError):
    """A missing or unusable setting; the message names the variable, never a value."""


def _key(env: Mapping[str, str], names: tuple[str, str]) -> S3Key:
    values = [env.get(name, "").strip() for name in names]
    missing = [name for name, value in zip(names, values, strict=True) if not value]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} not set (compose: the s3 service's env_file)")
    return S3Key(*values)


def identities_from_env(env: Mapping[str, str], bucket: str) -> list[Identity]:
    """The administrator and the workers' user of `bucket`, keys from env."""
    admin, worker = _key(env, ADMIN_KEY), _key(env, WORKER_KEY)
    if admin.access_key_id == worker.access_key_id:
        # One access key id names one identity: the workers would be the administrator.
        raise ConfigError(f"{WORKER_KEY[0]} is {ADMIN_KEY[0]}: give the workers their own key")
    return [Identity("admin", admin), Identity("ddpflow-worker", worker, bucket=bucket)]


def weed_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: env[name] for name in WEED_ENV if name in env}


def _forward_stop(proc: subprocess.Popen[bytes], stopping: list[int]) -> None:
    """On SIGTERM/SIGINT: the same to weed, SIGKILL if it is still there after STOP_WAIT_S;
    the signal is recorded in `stopping`. The handler does not wait itself: the main thread
    is in proc.wait(), which holds the lock a second wait would need."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        proc.send_signal(signum)  # a no-op once weed has been reaped
        killer = threading.Timer(STOP_WAIT_S, proc.kill)
        killer.daemon = True
        killer.start()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def serve(port: int, data_dir: Path, config_dir: Path, bucket: str, bind: str) -> int:
    """Run the server until it exits or is told to stop; weed's exit status."""
    identities = identities_from_env(os.environ, bucket)
    # No ready file from an earlier run may count (compose also gives the folder a fresh tmpfs).
    (config_dir / READY).unlink(missing_ok=True)
    prepared = prepare(port, data_dir, config_dir, identities, s3_bind=bind)
    # weed logs to this process's stdout/stderr: the container's log.
    proc = subprocess.Popen(
        prepared.argv,
        stdin=subprocess.DEVNULL,
        env=weed_env(os.environ),
        cwd=prepared.config.dir,  # weed reads ./security.toml
        umask=0o077,
    )
    stopping: list[int] = []
    _forward_stop(proc, stopping)
    # The waits check the leader by pid; there is no log file to quote (it is stdout).
    service = Service("seaweedfs", proc.pid, f"http://{LOOPBACK}:{port}", Path(os.devnull))
    try:
        wait_for_buckets(service, identities, [bucket])
    except ServiceError as error:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        _remove_sockets(prepared.ports)
        if stopping:
            return 0
        print(f"serve: {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    (prepared.config.dir / READY).write_text("")
    print(f"serve: S3 on {bind}:{port}, bucket {bucket} ready", flush=True)
    code = proc.wait()
    _remove_sockets(prepared.ports)
    # Stopped on request: a clean stop, whether weed left on the signal or was killed.
    return 0 if stopping else _exit_status(code)


def _remove_sockets(ports: dict[str, int]) -> None:
    """The unix sockets weed leaves in /tmp, which a restarted container keeps."""
    for path in grpc_socket_paths(ports):
        path.unlink(missing_ok=True)


def _exit_status(returncode: int) -> int:
    """A shell's status for weed's exit: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.seaweedfs.serve", description=__doc__)
    parser.add_argument("--port", type=int, default=9000, help="the S3 gateway's port")
    parser.add_argument("--bind", default="0.0.0.0", help="the S3 gateway's address")
    parser.add_argument("--data", type=Path, default=Path("/data"), help="SeaweedFS's data")
    parser.add_argument(
        "--config",
        type=Path,
        default=Path("/run/ddpflow/s3"),
        help="a folder made afresh (0700) at each start for the configuration and `ready`",
    )
    parser.add_argument("--bucket", default="ddpflow", help="made at start; the workers' only")
    args = parser.parse_args(argv)
    try:
        return serve(args.port, args.data, args.config, args.bucket, args.bind)
    except ConfigError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
