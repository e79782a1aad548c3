"""Process plumbing: spawn in a new session, wait for health, stop the whole process group.

Every service runs as the leader of its own session, so one `killpg` reaches the children it
spawns (dask nannies and workers, mlflow's uvicorn, ...). Stop also sweeps descendants that
left the group (Prefect runs flow runs in their own session) so nothing is orphaned.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil


class ServiceError(RuntimeError):
    """A service failed to start, answer or stop; the message names it, its URL and its log."""


@dataclass
class Service:
    """One started process group: its leader's pid, where it answers and where it logs."""

    name: str
    pid: int
    url: str
    log_path: Path
    stop_signal: int = int(signal.SIGTERM)
    # How long stop() waits after stop_signal before SIGKILL.
    stop_wait_s: float = 15.0
    # The leader's start (process_start) guards against signalling an unrelated process after
    # pid reuse.
    create_time: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pgid(self) -> int:
        # start_new_session=True makes the leader's pid its group id.
        return self.pid

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "log_path": str(self.log_path), "pgid": self.pgid}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Service:
        fields = {k: v for k, v in data.items() if k != "pgid"}
        return cls(**{**fields, "log_path": Path(data["log_path"])})


# Popen objects of the services this process started: polling them reaps the exited leader,
# which would otherwise linger as a zombie that still "exists".
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


# Where free_port draws from: below the kernel's ephemeral range (see free_port).
_PORTS_FROM = 20000
_PICK = random.SystemRandom()  # not the `random` module's state, which a test may seed alike


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports picked by bind(0) and outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):  # not Linux: the IANA range, which BSDs and macOS use
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` right now, for a service started next to bind.

    Chosen below the ephemeral range, not by bind(0): a port the OS picks comes from that
    range, which every outgoing connection and every other bind(0) on the machine draws from
    too, so between this call and the service's bind one of them could take it ("address
    already in use", seen with three test processes side by side). A port below the range is
    taken only by an explicit bind, such as another free_port's service: a random pick among
    thousands makes that rare.
    """
    low, _ = ephemeral_ports()
    if low - _PORTS_FROM < 1000:  # a machine whose range starts low: take the OS's pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    for _ in range(100):
        port = _PICK.randrange(_PORTS_FROM, low)
        if _bindable(host, port):
            return port
    raise ServiceError(f"no free port on {host} between {_PORTS_FROM} and {low}")


def free_ports(names: Iterable[str], taken: Iterable[int] = ()) -> dict[str, int]:
    """A distinct free port (free_port) for each name, none of them one of `taken`."""
    used = set(taken)
    ports: dict[str, int] = {}
    for name in names:
        port = free_port()
        while port in used:
            port = free_port()
        ports[name] = port
        used.add(port)
    return ports


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def port_is_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:port (SO_REUSEADDR ignores TIME_WAIT leftovers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def spawn(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    log_dir: Path,
    cwd: Path | None = None,
    umask: int = -1,
) -> Service:
    """Start argv as a new session leader, stdout and stderr appended to <log_dir>/<name>.log.

    umask: the child's (e.g. 0o077 for a server whose sockets and files only its user may open);
    -1 keeps ours."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            umask=umask,
        )
    _CHILDREN[proc.pid] = proc
    try:
        create_time = process_start(psutil.Process(proc.pid))
    except psutil.Error:  # exited at once: the health wait reports it with its log
        create_time = 0.0
    return Service(name, proc.pid, "", log_path, create_time=create_time)


def process_start(proc: psutil.Process) -> float:
    """When `proc` started, to tell it from a later process given the same pid. On Linux in
    seconds since boot: psutil's create_time() is that plus the boot time, which the kernel
    recomputes from the wall clock at each read of /proc/stat, so a step of the clock (a
    machine paused and resumed, NTP) moves every process's create_time() at once. One of
    about a minute during a full test run made each service started before it look like
    another process under its pid: its stop signalled nothing and left it running (an MLflow
    server went on serving through the outage a test had just begun). Elsewhere, as psutil
    gives it."""
    started = proc.create_time()
    return started - psutil.boot_time() if sys.platform.startswith("linux") else started


def same_start(recorded: float, proc: psutil.Process) -> bool:
    """True if `proc` is the process whose process_start was `recorded`."""
    return abs(process_start(proc) - recorded) < 0.05  # psutil's ticks are 0.01 s


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    """True if pid runs (a zombie is dead) and, when given, is the process that started at
    create_time (process_start)."""
    if pid in _CHILDREN and _CHILDREN[pid].poll() is not None:
        return False
    try:
        proc = psutil.Process(pid)
        if create_time is not None and not same_start(create_time, proc):
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def log_tail(path: Path, num_lines: int = 30) -> str:
    """The last lines of a log, for error messages."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return "\n".join(lines[-num_lines:])


def failure(service: Service, problem: str) -> ServiceError:
    """An error that says which service, where it answers, and what its log says."""
    return ServiceError(
        f"{service.name} (pid {service.pid}, {service.url or 'no url'}) {problem}.\n"
        f"Log {service.log_path}, last lines:\n{log_tail(service.log_path)}"
    )


def wait_until(
    check: Callable[[], bool], timeout_s: float, service: Service, what: str, poll_s: float = 0.3
) -> None:
    """Poll check() until it is true; fail at once if the service's leader exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not pid_alive(service.pid):
            raise failure(service, f"exited before {what}")
        try:
            if check():
                return
        except Exception:  # a not-yet-ready service may fail in any way
            pass
        if time.monotonic() > deadline:
            raise failure(service, f"did not report {what} within {timeout_s:.0f} s")
        time.sleep(poll_s)


# Local services only: never route 127.0.0.1 through an HTTP(S)_PROXY from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout_s: float = 3.0) -> bool:
    """True if a GET on url answers 2xx."""
    with _NO_PROXY_OPENER.open(url, timeout=timeout_s) as resp:
        return 200 <= resp.status < 300


def wait_http(url: str, timeout_s: float, service: Service | None = None) -> None:
    """Wait until url answers 2xx; the error names the service, the url and the log tail."""
    # Without a service, only the url can be named (and there is no process to watch).
    target = service or Service("service", os.getpid(), url, Path("/dev/null"))
    wait_until(lambda: http_ok(url), timeout_s, target, f"healthy at {url}")


def tcp_ok(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """True if something accepts TCP connections on host:port."""
    with socket.create_connection((host, port), timeout=timeout_s):
        return True


def _group_is_ours(service: Service) -> bool:
    """False if the leader's pid now belongs to another process (reused after our group died).

    Linux keeps a pid reserved while it is any live process's group id, so as long as our
    group has members, pid == pgid cannot have been handed to an unrelated process.
    """
    try:
        return same_start(service.create_time, psutil.Process(service.pid))
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def members(service: Service) -> list[psutil.Process]:
    """The live processes of a service: its group plus every descendant, even in other groups."""
    if not _group_is_ours(service):
        return []
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == service.pgid:
                found[proc.pid] = proc
        except OSError:
            continue
    for proc in list(found.values()):
        try:
            found.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.Error:
            continue
    return [proc for proc in found.values() if _running(proc)]


def _send(service: Service, procs: list[psutil.Process], sig: int) -> None:
    """Signal the group at once, then any member that left the group (own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(service.pgid, sig)
    for proc in procs:
        try:
            if os.getpgid(proc.pid) != service.pgid:
                proc.send_signal(sig)
        except (OSError, psutil.Error):
            continue


def _running(proc: psutil.Process) -> bool:
    """True if proc still runs; is_running() also detects a reused pid by its start time."""
    if proc.pid in _CHILDREN and _CHILDREN[proc.pid].poll() is not None:
        return False
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until every process is gone; return the survivors."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    return alive


def stop(service: Service, timeout_s: float | None = None) -> None:
    """Stop a service and everything it spawned: its stop signal, a wait (`timeout_s`, else
    the service's stop_wait_s), then SIGKILL."""
    timeout_s = service.stop_wait_s if timeout_s is None else timeout_s
    procs = members(service)
    if procs:
        _send(service, procs, service.stop_signal)
        alive = _wait_gone(procs, timeout_s)
        # A second sweep catches children started while shutting down (a nanny's restart).
        alive += [p for p in members(service) if p.pid not in {a.pid for a in alive}]
        if alive:
            _send(service, alive, signal.SIGKILL)
            alive = _wait_gone(alive, 5)
        if alive:
            pids = ", ".join(str(p.pid) for p in alive)
            raise failure(service, f"left processes {pids} alive after SIGKILL")
    popen = _CHILDREN.pop(service.pid, None)
    if popen is not None:
        popen.poll()
    # Files the service leaves behind that a later one on the same ports would trip over.
    for path in service.extra.get("remove_after_stop", ()):
        Path(path).unlink(missing_ok=True)
