"""Local TCP ports for servers a test starts on a port it chooses (to restart them in place)."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A local TCP port nothing listens on now (bound to 127.0.0.1, then released)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct local TCP ports nothing listens on now. Each is bound until all are
    chosen: ports picked one after another, each released before the next is asked for, may
    repeat (the kernel hands a released ephemeral port out again), and two servers given the
    same port, or a members list naming one member twice, fail to start."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports
