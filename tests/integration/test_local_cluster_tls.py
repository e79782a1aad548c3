"""The LocalCluster a flow starts takes only clients with its own per-run credentials: another
OS user of the same machine cannot submit code to it (docs/security.md).

A throwaway OS user is created (so the test runs as root; it skips otherwise) and removed at
the end. It plays the local attacker with a real Dask client of its own: without a
certificate, with a certificate of its own making, over plain tcp://, and with a bare TLS
handshake that shows no certificate. The cluster is started as the flow starts it: by the
flow's task runner, and by the early start beside the embedded API that the runner adopts.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import distributed
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from ddpflow.config import Settings
from ddpflow.integrations.prefect import early_cluster
from ddpflow.integrations.prefect import task_runner as runner
from tests.helpers.stranger_worker import readable_packages

pytestmark = pytest.mark.integration

# Never contacted: the early start and the runner only compare it (and hand it to workers).
API_URL = "http://127.0.0.1:9/api"
# What the other user runs: each attempt prints "refused: ..." or "REACHED: ...".
STRANGER = r"""
import json, os, socket, ssl, sys
import distributed
from distributed.security import Security

address = sys.argv[1]
host_port = address.split("://", 1)[1]
results = {}

def attempt(name, addr, security):
    try:
        with distributed.Client(addr, timeout=3, security=security) as client:
            uid = client.submit(os.getuid, pure=False).result(timeout=10)
            results[name] = f"REACHED: ran os.getuid() on the cluster, got {uid}"
    except Exception as error:
        results[name] = f"refused: {type(error).__name__}: {error}"[:300]

attempt("no_certificate", address, None)
attempt("own_certificate", address, Security.temporary())
attempt("plain_tcp", "tcp://" + host_port, None)
host, port = host_port.rsplit(":", 1)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
try:
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw) as tls:
            tls.sendall(b"\0" * 8)
            answer = tls.recv(1)  # TLS 1.3: the refusal arrives with the first read
    results["tls_handshake"] = "refused: closed" if answer == b"" else "REACHED: it answered"
except (ssl.SSLError, OSError) as error:
    results["tls_handshake"] = f"refused: {type(error).__name__}: {error}"[:300]
print(json.dumps(results))
"""


class OtherUser:
    """A throwaway OS user with its own home folder, and a Python it can run with Dask."""

    def __init__(self) -> None:
        self.name = f"ddpflow-t{uuid.uuid4().hex[:8]}"
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", self.name],
            check=True,
            capture_output=True,
        )
        self.home = Path(tempfile.mkdtemp(prefix="ddpflow-other-user-", dir="/tmp"))
        entry = pwd.getpwnam(self.name)
        os.chown(self.home, entry.pw_uid, entry.pw_gid)
        self.uid = entry.pw_uid
        self.python = self._python()

    def run(self, python: str, *args: str) -> subprocess.CompletedProcess[str]:
        # A clean environment: nothing of ours (no Dask TLS settings) reaches the user.
        # The venv's Dask, copied where the user can read it: the checkout may be in a
        # folder only root can enter (a clone under /root).
        packages = readable_packages("distributed", "cryptography")
        env = [f"HOME={self.home}", f"PYTHONPATH={packages}"]
        command = ["runuser", "-u", self.name, "--", "env", "-i", *env, python, *args]
        return subprocess.run(
            command, cwd=self.home, capture_output=True, text=True, timeout=120, check=False
        )

    def _python(self) -> str:
        """The venv's interpreter, or, where the other user cannot run it (its base
        interpreter lives under root's 0700 home here), the system's python of the same
        version: an attacker needs any Dask client, and this one is ours on the venv's
        packages (copied)."""
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        for python in (sys.executable, f"/usr/bin/python{version}"):
            if self.run(python, "-c", "import distributed, cryptography").returncode == 0:
                return python
        pytest.skip(f"user {self.name} can run no Python {version} with the venv's Dask")

    def remove(self) -> None:
        subprocess.run(["pkill", "-KILL", "-u", self.name], check=False)  # only its own
        subprocess.run(["userdel", self.name], check=False, capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module")
def other_user() -> Iterator[OtherUser]:
    if os.geteuid() != 0:
        pytest.skip("creating a second OS user (useradd) needs root; run the test as root")
    if not (shutil.which("useradd") and shutil.which("runuser")):
        pytest.skip("useradd and runuser (util-linux) are needed to act as another OS user")
    user = OtherUser()
    try:
        yield user
    finally:
        user.remove()


@pytest.fixture
def default_settings(monkeypatch, tmp_path: Path) -> Settings:
    """The defaults every flow gets: nothing about the cluster set."""
    for name in list(os.environ):
        if name.startswith("DDPFLOW_") or name.startswith("DASK_DISTRIBUTED__COMM"):
            monkeypatch.delenv(name)
    return Settings.from_env(project_dir=tmp_path)


def _whoami_scheduler() -> str:
    """A task: its worker's own client (the one ranks get) talks to the scheduler."""
    return distributed.get_client().scheduler_info()["address"]


def _secrets_in_process_listing(pids: list[int]) -> list[str]:
    """Command lines any user can read (and environments) that hold a private key."""
    found = []
    for pid in pids:
        for part in ("cmdline", "environ"):
            if b"PRIVATE KEY" in Path(f"/proc/{pid}/{part}").read_bytes():
                found.append(f"/proc/{pid}/{part}")
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start", ["runner", "early_hand_off"])
def test_another_local_user_cannot_use_the_flows_cluster(
    other_user: OtherUser, default_settings: Settings, start: str
) -> None:
    with temporary_settings(updates={PREFECT_API_URL: API_URL}):
        if start == "early_hand_off":
            early_cluster.start_early(API_URL)
            assert early_cluster._pending is not None, "the default cluster starts early"
            early = early_cluster._pending[3]
        task_runner = runner.dask_task_runner(default_settings)
        with task_runner:
            client = task_runner.client
            cluster = task_runner._cluster
            if start == "early_hand_off":
                assert cluster is early.result(), "the runner adopted the early cluster"
            address = cluster.scheduler_address

            attacker = other_user.run(other_user.python, "-c", STRANGER, address)
            assert attacker.returncode == 0, attacker.stderr[-3000:]
            attempts = json.loads(attacker.stdout.strip().splitlines()[-1])
            reached = {k: v for k, v in attempts.items() if not v.startswith("refused")}
            assert not reached, f"user {other_user.name} reached the flow's cluster: {reached}"
            assert address.startswith("tls://127.0.0.1:"), address

            # Ours connect: the runner's client, the workers' own clients, the nannies.
            client.wait_for_workers(default_settings.num_dask_workers, timeout=120)
            assert client.submit(sum, [1, 2]).result(timeout=60) == 3
            workers = list(client.scheduler_info()["workers"])
            assert workers and all(worker.startswith("tls://") for worker in workers)
            seen = [
                client.submit(_whoami_scheduler, workers=[w], pure=False).result(timeout=60)
                for w in workers
            ]
            assert seen == [address] * len(workers)
            nannies = client.run(os.getpid, nanny=True)  # the scheduler reaches each nanny
            assert nannies and all(nanny.startswith("tls://") for nanny in nannies)
            assert not _secrets_in_process_listing(list(client.run(os.getpid).values()))
