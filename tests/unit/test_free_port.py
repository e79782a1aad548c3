"""infra.procs.free_port picks a port that no bind(0) or outgoing connection can take before
the service it is for binds it: one below the kernel's ephemeral range, free when picked."""

from __future__ import annotations

import socket

from infra.procs import ephemeral_ports, free_port


def test_a_free_port_lies_below_the_range_the_os_picks_from_and_can_be_bound() -> None:
    low, high = ephemeral_ports()
    assert 1024 < low < high <= 65535
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports), (sorted(ports), low)
    assert len(ports) > 1, "picks must vary, or two test processes would collide"
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_holds_is_never_picked(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        port = taken.getsockname()[1]
        # Draws that would land on the taken port first, then on a free one.
        draws = iter([port, port, port + 1 if port + 1 < ephemeral_ports()[0] else port - 1])
        monkeypatch.setattr("infra.procs._PICK.randrange", lambda *_: next(draws))
        assert free_port() != port
