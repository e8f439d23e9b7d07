"""Test helpers that talk to a server over a plain socket, independently of the client."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import cast

from celery_dflock import protocol


def raw_request(address: tuple[str, int], request: bytes, timeout: float = 10.0) -> bytes:
    """Send one request on a fresh connection and return the reply line (without newline)."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"server closed the connection after {data!r}")
            data += chunk
    return data[:-1]


def stats(address: tuple[str, int]) -> dict[str, object]:
    """The server's ``stats`` JSON."""
    line = raw_request(address, protocol.encode_stats())
    assert line.startswith(b"ok "), line
    return cast(dict[str, object], json.loads(line[3:]))


def held_keys(address: tuple[str, int]) -> set[str]:
    """Keys of the locks currently held on that server."""
    locks = cast(list[dict[str, object]], stats(address)["locks"])
    return {str(entry["key"]) for entry in locks}


def holders_and_waiters(
    address: tuple[str, int], key: str, semaphore: bool = False
) -> tuple[int, int]:
    """(holders, waiters) of a lock or semaphore key, as the server's ``stats`` shows them."""
    section = "semaphores" if semaphore else "locks"
    for entry in cast(list[dict[str, object]], stats(address)[section]):
        if entry["key"] == key:
            held = cast(int, entry["holders"]) if semaphore else 1
            return held, cast(int, entry["waiters"])
    return 0, 0


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` (server state that cannot be awaited) until true, or fail."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.01)


def connection_count(address: tuple[str, int]) -> int:
    """Connections the server counts (including the one asking)."""
    return cast(int, stats(address)["connections"])


def release_behind_its_back(
    address: tuple[str, int], key: str, token: str, semaphore: bool = False
) -> None:
    """Release ``token`` from another connection (tokens are bearer credentials)."""
    encode = protocol.encode_sem_release if semaphore else protocol.encode_release
    assert raw_request(address, encode(key, token)) == b"ok"
