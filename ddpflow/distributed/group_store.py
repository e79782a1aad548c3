"""The group's key-value store, kept to the group: bound to one address, sealed with a secret.

The ranks of a group meet through a torch TCPStore that rank 0 serves (gloo's rendezvous,
main_io's words). A TCPStore has no authentication: whoever reaches its port may list,
read, set and delete any key. Two things narrow who that is and what they can do:

- Rank 0's store listens on its worker's address only. TCPStore's `host` argument names
  where clients connect, not where the server listens: its server binds `::` (or 0.0.0.0)
  whatever the host. So the listening socket is made here, bound to that address, and
  handed over with `master_listen_fd`. It is made when the launcher asks rank 0's worker
  for the group's port (`reserve_store_port`), not when rank 0 starts: a port that was
  only found free and released could be handed by the system to any other bind to port 0
  on that host in between (another group's gloo pairs, a Dask comm), and the group would
  fail to form.
- The group reads and writes through a SealedStore keyed by a per-launch 128-bit token that
  the launcher makes in the flow process and sends to the ranks over Dask's own channel.
  Every name the server holds is an HMAC of the group's name, and every value is encrypted
  and authenticated with AES-SIV, each under a key drawn from the token (sealed_store.py).
  Someone who connects and lists the keys sees opaque names and reads opaque values; what
  they write is detected (SealBroken) instead of believed; they cannot compute the name of
  a key the group will read next; and nothing carries over from one launch to the next.

What a stranger who reaches the port can still do is stop the group (delete or overwrite
an entry, fill the server's memory), so the store is only as available as the network
between the workers is private (docs/security.md). Nothing of ours writes the token down:
it is kept out of the rank spec's repr (Dask logs a failed task with its arguments) and out
of any error that leaves the group.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:  # torch is imported where used: the flow process imports this package
    import torch.distributed as dist

HIDDEN = "***"
# A reserved port whose rank 0 has not come for it by then is given up (a launch that failed
# before its ranks started); rank 0 coming later binds the port itself.
RESERVATION_TTL_S = 600.0

# This worker's reserved store sockets: port -> (listening socket, when reserved).
_reserved: dict[int, tuple[socket.socket, float]] = {}
_reserved_lock = threading.Lock()


def reserve_store_port(host: str) -> int:
    """On rank 0's worker, asked by the launcher: a port for the group's store, listening
    on `host` only from now until rank 0 opens the store on it (open_group_store)."""
    sock = listening_socket(host, 0)
    now = time.monotonic()
    with _reserved_lock:
        for old_port, (old, since) in list(_reserved.items()):
            if now - since > RESERVATION_TTL_S:
                old.close()
                del _reserved[old_port]
        port = sock.getsockname()[1]
        _reserved[port] = (sock, now)
    return port


def _take_reserved(port: int) -> socket.socket | None:
    with _reserved_lock:
        entry = _reserved.pop(port, None)
    return entry[0] if entry else None


def open_group_store(
    host: str,
    port: int,
    world_size: int,
    is_master: bool,
    timeout: timedelta,
    token: str | None,
) -> dist.Store:
    """Rank 0 serves the store on `host`:`port` only; every rank gets it sealed with `token`.

    `token` None leaves names and values plain (a group set up by hand, not by the launcher).
    """
    import torch.distributed as dist

    listen_fd = None
    if is_master:
        # The port's socket, reserved on this worker or (a group set up by hand, a
        # reservation given up) bound now. The store's server owns it from here: it closes
        # it when the store goes.
        sock = _take_reserved(port) or listening_socket(host, port)
        listen_fd = sock.detach()
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=timeout,
        # No multi_tenant (which torch's tcp:// init sets): a server cached for the same
        # port in this process would be reused and our socket ignored. One rank per worker
        # and a fresh port per launch: nothing to share.
        master_listen_fd=listen_fd,
    )
    if not token:
        return store
    from ddpflow.distributed.sealed_store import SealedStore  # imports torch

    return SealedStore(store, token)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` only (an IPv4 or IPv6 address, or a name)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICSERV
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As torch's own server does: a port left in TIME_WAIT by an earlier group binds.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


@contextmanager
def token_kept_out_of_errors(token: str | None) -> Iterator[None]:
    """Any error leaving this block shows `***` where the token was.

    A last guard: the group's store names keys by their plain names in its errors
    (sealed_store), never by the token, but an error leaving a rank reaches the worker's
    log, the launcher's LaunchError, and the flow's log and state, so no text that quotes
    the token gets that far.
    """
    try:
        yield
    except Exception as error:
        if token and not _hide(error, token):
            # An error whose text does not come from its args: keep its words, not its type.
            raise RuntimeError(f"{type(error).__name__}: {_text(error, token)}") from None
        raise


def _hide(error: BaseException, token: str) -> bool:
    """Rewrite the token out of `error`'s args and notes, and those of its causes; True if
    no trace of it is left in their text."""
    seen: set[int] = set()
    current: BaseException | None = error
    clean = True
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.args = tuple(_hidden(arg, token) for arg in current.args)
        notes = getattr(current, "__notes__", None)
        if notes:
            current.__notes__ = [_hidden(note, token) for note in notes]
        clean = clean and token not in str(current) and token not in repr(current)
        current = current.__cause__ or current.__context__
    return clean


@overload
def _hidden(value: str, token: str) -> str: ...
@overload
def _hidden(value: object, token: str) -> object: ...
def _hidden(value: object, token: str) -> object:
    return value.replace(token, HIDDEN) if isinstance(value, str) else value


def _text(error: BaseException, token: str) -> str:
    return str(error).replace(token, HIDDEN)
