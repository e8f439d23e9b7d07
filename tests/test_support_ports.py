"""tests/support/ports: ports for servers a test starts on ports of its choosing."""

from __future__ import annotations

import socket

from tests.support.ports import free_port, free_ports


def test_ports_asked_for_together_are_distinct() -> None:
    """A fleet's ports are asked for together. Asked for one after another, each released
    before the next, they may repeat (the kernel hands a released port out again): CI once
    started a static fleet whose members list named one port twice, and its servers refused
    the list. 500 sequential picks repeat a port almost always (about 99%); these never do."""
    ports = free_ports(500)
    assert len(set(ports)) == len(ports)
    assert all(0 < port < 65536 for port in ports)


def test_a_single_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
