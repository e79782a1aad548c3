"""Who listens on a TCP port, read from the kernel's own tables (/proc/net/tcp and tcp6):
every socket of this network namespace, whatever process holds it."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

LISTEN = "0A"  # the TCP state code of a listening socket in /proc/net/tcp*


def listening_addresses(port: int) -> set[str]:
    """The local addresses that sockets listening on `port` are bound to ("0.0.0.0" and
    "::" for every address)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] == LISTEN and int(port_hex, 16) == port:
                found.add(str(_decode(address)))
    return found


def _decode(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The kernel prints each 32-bit word of the address in host byte order: 127.0.0.1 is
    0100007F on a little-endian machine."""
    step = -1 if sys.byteorder == "little" else 1
    words = [bytes.fromhex(address[i : i + 8])[::step] for i in range(0, len(address), 8)]
    return ipaddress.ip_address(b"".join(words))
