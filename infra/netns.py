"""Several "hosts" on one Linux machine: network namespaces on a private bridge (root only).

Each namespace is a host with its own IP, loopback and ports; the file system stays shared
(like NFS on a real cluster). The machine itself (the root namespace) holds the bridge's
first address, so servers it runs on that address are reachable from every host, as a head
node's would be. Used by the multi-host tests and the multi-host benchmark; `partition`
cuts a host off the network (link down) and `reconnect` brings it back, which is how a
switch port or cable fault looks to the processes on both sides.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

IP = shutil.which("ip") or "/usr/sbin/ip"
INTERFACE = "eth0"  # the host side of each namespace's veth pair is renamed to this


class NetnsError(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, no kernel support)."""


@dataclass
class Hosts:
    """A bridge plus one namespace per host; `address[name]` is that host's IP."""

    bridge: str
    bridge_address: str
    address: dict[str, str] = field(default_factory=dict)
    namespace: dict[str, str] = field(default_factory=dict)

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv run inside host's namespace (`ip netns exec` execs it: same pid)."""
        return [IP, "netns", "exec", self.namespace[host], *argv]

    def partition(self, host: str) -> None:
        """Cut host off: its link goes down, packets to and from it are lost (no reset)."""
        _ip("-n", self.namespace[host], "link", "set", INTERFACE, "down")

    def reconnect(self, host: str) -> None:
        _ip("-n", self.namespace[host], "link", "set", INTERFACE, "up")

    def pids(self, host: str) -> list[int]:
        done = subprocess.run(
            [IP, "netns", "pids", self.namespace[host]],
            capture_output=True, text=True, check=False, timeout=10,
        )  # fmt: skip
        return [int(p) for p in done.stdout.split()]


def _ip(*args: str) -> None:
    done = subprocess.run([IP, *args], capture_output=True, text=True, check=False, timeout=10)
    if done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def can_make_namespaces() -> str | None:
    """None if this process can build hosts, else why not (for a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(IP):
        return "the `ip` command (iproute2) is not installed"
    name = f"ddpf-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except NetnsError as error:
        return str(error)
    _ip("netns", "del", name)
    return None


@contextlib.contextmanager
def hosts(names: Sequence[str], subnet: int | None = None) -> Iterator[Hosts]:
    """Make one namespace per name on a fresh bridge 10.<subnet>.0.0/24; remove all at exit.

    Processes still running in a namespace at exit are killed first, so nothing outlives
    the hosts. A random subnet and names keep concurrent runs apart.
    """
    tag = secrets.token_hex(3)
    octet = subnet if subnet is not None else 100 + secrets.randbelow(150)
    made = Hosts(bridge=f"ddpf{tag}", bridge_address=f"10.{octet}.0.1")
    try:
        _ip("link", "add", made.bridge, "type", "bridge")
        _ip("addr", "add", f"{made.bridge_address}/24", "dev", made.bridge)
        _ip("link", "set", made.bridge, "up")
        for index, name in enumerate(names):
            add_host(made, name, f"ddpf{tag}-{name}", f"10.{octet}.0.{index + 2}", tag, index)
        yield made
    finally:
        _remove(made)


def add_host(made: Hosts, name: str, namespace: str, address: str, tag: str, index: int) -> None:
    """One more namespace `name` at `address` on `made`'s bridge (`index` names its veth
    pair); removed with the others at exit."""
    inner, outer = f"dv{tag}{index}", f"dh{tag}{index}"  # veth names: 15 characters at most
    _ip("netns", "add", namespace)
    made.namespace[name] = namespace
    _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
    _ip("link", "set", inner, "netns", namespace)
    _ip("link", "set", outer, "master", made.bridge)
    _ip("link", "set", outer, "up")
    _ip("-n", namespace, "link", "set", inner, "name", INTERFACE)
    _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", INTERFACE)
    _ip("-n", namespace, "link", "set", INTERFACE, "up")
    _ip("-n", namespace, "link", "set", "lo", "up")
    made.address[name] = address


def _remove(made: Hosts) -> None:
    for name, namespace in made.namespace.items():
        for pid in made.pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        with contextlib.suppress(NetnsError):
            _ip("netns", "del", namespace)
    with contextlib.suppress(NetnsError):
        _ip("link", "del", made.bridge)
