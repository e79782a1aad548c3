"""A real one-node Slurm cluster for the `slurm` tests: munged, slurmctld and slurmd.

Everything lives in one folder (config, state, spool, logs, munge socket), so the test
cluster never touches a system Slurm or munge. The daemons run in the foreground as our
children, so teardown can stop exactly them. Slurm and munge come from Debian's packages,
installed with apt-get when missing (root only).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from infra.procs import free_port

PARTITION = "ddpflow"
APT_TIMEOUT_S = 600
START_TIMEOUT_S = 60
MUNGE_KEY = Path("/etc/munge/munge.key")
# The daemons live in sbin, which a non-login shell's PATH may lack.
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


@dataclass
class Slurm:
    """A running test cluster; `env` is what sbatch, squeue and scancel need."""

    conf: Path
    partition: str
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, timeout_s: float = 30) -> str:
        result = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
        return result.stdout

    def jobs(self, name: str | None = None) -> dict[str, str]:
        """Job id -> state of every job (named `name`) Slurm still knows about."""
        names = [f"--name={name}"] if name else []
        out = self.run("squeue", "--noheader", "--format=%i %T", *names)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def cancel(self, name: str) -> None:
        """Cancel every job named `name` (a test's leftovers, should its flow not have)."""
        self.run("scancel", f"--name={name}")


def unavailable(reason: str) -> None:
    """Skip where Slurm cannot be set up outside CI; on CI (CI=true) a skip would hide that
    the tests never ran, so it fails instead."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Slurm tests cannot run: {reason}")
    pytest.skip(reason)


def daemon(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def ensure_installed() -> None:
    if daemon("slurmctld") and daemon("slurmd") and daemon("munged"):
        return
    if os.geteuid() != 0:
        unavailable("Slurm (slurm-wlm, munge) is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        unavailable("Slurm (slurm-wlm, munge) is not installed and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"],
    ):
        result = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S
        )
        if result.returncode != 0:
            pytest.fail(f"{' '.join(argv)} failed: {result.stderr[-2000:]}")


def slurm_conf(root: Path, host: str, ports: tuple[int, int], munge_socket: Path) -> str:
    cpus = os.cpu_count() or 1
    # slurmd drains a node whose configured memory exceeds what it finds, so stay below it.
    memory_mb = int(psutil.virtual_memory().total / 2**20 * 0.9)
    return f"""\
ClusterName=ddpflowtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
MpiDefault=none
# No cgroups in a container: track job processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
# FORCE:4 shares each core among up to 4 jobs, so jobs still start on a busy small machine.
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _free_ports(count: int) -> tuple[int, ...]:
    ports: set[int] = set()
    while len(ports) < count:  # two picks may coincide
        ports.add(free_port())
    return tuple(sorted(ports))


def _ensure_munge_key() -> None:
    if MUNGE_KEY.exists():
        return
    MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
    MUNGE_KEY.write_bytes(secrets.token_bytes(1024))
    MUNGE_KEY.chmod(0o400)
    shutil.chown(MUNGE_KEY, "munge", "munge")


def _wait(check, what: str, slurm: Slurm, root: Path, timeout_s: float = START_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in slurm.procs:
            if proc.poll() is not None:
                break
        else:
            try:
                if check():
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.5)
            continue
        break
    logs = "\n".join(
        f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(root.glob("log/*"))
    )
    raise RuntimeError(f"Slurm test cluster: {what} did not happen\n{logs}")


@contextmanager
def slurm_cluster(root: Path) -> Iterator[Slurm]:
    """Start munged, slurmctld and slurmd under `root`; stop them (and any job) on exit."""
    ensure_installed()
    if os.geteuid() != 0:
        unavailable("the Slurm test cluster runs its daemons as root (SlurmUser=root)")
    _ensure_munge_key()
    for sub in ("state", "spool", "log", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o755)
    munge_socket = root / "munge" / "munge.socket"
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, _free_ports(2), munge_socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    slurm = Slurm(conf, PARTITION, env)
    daemons = [
        ["munged", "--foreground", "--force", f"--socket={munge_socket}",
         f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/log/munged.log",
         f"--seed-file={root}/munge/munged.seed"],
        ["slurmctld", "-D", "-i", "-f", str(conf)],
        ["slurmd", "-D", "-f", str(conf)],
    ]  # fmt: skip
    try:
        for argv in daemons:
            argv[0] = daemon(argv[0]) or argv[0]
            with (root / "log" / f"{Path(argv[0]).name}.out").open("w") as out:
                slurm.procs.append(
                    subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
            if argv[0].endswith("munged"):
                _wait(munge_socket.exists, "munged's socket appeared", slurm, root)
        _wait(
            lambda: slurm.run("sinfo", "--noheader", "--format=%t").split() == ["idle"],
            "the node became idle in sinfo",
            slurm,
            root,
        )
        yield slurm
    finally:
        stop(slurm)


def stop(slurm: Slurm) -> None:
    """Cancel every job, wait until they are gone, then stop the daemons we started."""
    if len(slurm.procs) == 3:  # all started: the jobs' processes go before their slurmd
        try:
            slurm.run("scancel", f"--partition={slurm.partition}", timeout_s=10)
            deadline = time.monotonic() + 30
            while slurm.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass  # a daemon already died: stop the others regardless
    for proc in reversed(slurm.procs):  # slurmd, slurmctld, munged
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
