"""Local TCP ports for servers a test starts on a port it chooses (to restart them in place)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A local TCP port nothing listens on now (bound to 127.0.0.1, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
