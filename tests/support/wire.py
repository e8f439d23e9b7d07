"""Talking to a lock server over a plain socket, independently of the client: a minimal
blocking line client (:class:`Wire`) and one-request helpers for the server's ``stats``."""

from __future__ import annotations

import gc
import json
import socket
import ssl
import warnings
from types import TracebackType
from typing import Any, cast

from celery_dflock.client import _requests
from celery_dflock.client._requests import checked_release
from dflockd_server import constants
from dflockd_server.fence import fence_of

REPLY_TIMEOUT_S = 10.0
SERVER_COMMANDS = frozenset(
    value for name, value in vars(constants).items() if name.startswith("CMD_")
)
"""Every command the server knows (its ``CMD_`` constants)."""


class Wire:
    """One raw connection: send frames, read reply lines (every read bounded by a timeout)."""

    def __init__(
        self,
        address: tuple[str, int],
        timeout: float = REPLY_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
        source: str | None = None,
    ) -> None:
        """``source``: the local address to connect from (another loopback address, say)."""
        raw = socket.create_connection(
            address, timeout=timeout, source_address=None if source is None else (source, 0)
        )
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            raw = ssl_context.wrap_socket(raw, server_hostname=address[0])
        self.sock = raw
        self.reader = self.sock.makefile("rb")

    def send(self, cmd: str, key: str = "_", arg: str = "_") -> None:
        self.sock.sendall(f"{cmd}\n{key}\n{arg}\n".encode())

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> str:
        line = self.reader.readline()
        if not line:
            raise EOFError("server closed the connection")
        assert line.endswith(b"\n"), line
        return line[:-1].decode()

    def req(self, cmd: str, key: str = "_", arg: str = "_") -> str:
        self.send(cmd, key, arg)
        return self.recv()

    def stats(self) -> dict[str, Any]:
        """The server's ``stats`` reply, decoded (asked on this connection)."""
        status, payload = self.req("stats").split(" ", 1)
        assert status == "ok"
        result: dict[str, Any] = json.loads(payload)
        return result

    def assert_silent(self, seconds: float = 0.1) -> None:
        """Nothing arrives within ``seconds`` (only while no reply has been buffered)."""
        self.sock.settimeout(seconds)
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            return
        finally:
            self.sock.settimeout(REPLY_TIMEOUT_S)
        raise AssertionError(f"unexpected data from the server: {data!r}")

    def closed_by_server(self) -> bool:
        """True once the server has closed (EOF or reset), reading out any leftover replies."""
        try:
            while self.reader.readline():
                pass
        except (ConnectionResetError, BrokenPipeError):
            return True
        return True

    def lock(self, key: str, timeout: int = 0, lease: int | None = None) -> str:
        """Acquire and return the token; fail the test on any other reply."""
        self.send_lock(key, timeout, lease)
        return self.granted_token()

    def send_lock(self, key: str, timeout: int = 0, lease: int | None = None) -> None:
        """Send an acquire without reading its reply (`granted_token` reads it)."""
        self.send("l", key, f"{timeout}" if lease is None else f"{timeout} {lease}")

    def granted_token(self) -> str:
        """Read an acquire's reply and return its token; fail the test on any other reply."""
        reply = self.recv().split()
        assert reply[0] == "ok" and len(reply) == 3, reply
        return reply[1]

    def close(self) -> None:
        self.reader.close()
        self.sock.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def fence(token: str) -> int:
    return fence_of(token)


def unclosed_after_gc() -> list[str]:
    """What a garbage collection finds left open (its ResourceWarnings): sockets and
    transports that whoever made them never closed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


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
    line = raw_request(address, _requests.STATS_REQUEST)
    assert line.startswith(b"ok "), line
    return cast(dict[str, object], json.loads(line[3:]))


def shards(address: tuple[str, int]) -> dict[str, Any]:
    """The server's ``shards`` JSON, as sent (its mode, and in cluster mode the map)."""
    line = raw_request(address, b"shards\n_\n_\n")
    assert line.startswith(b"ok "), line[:200]
    return cast(dict[str, Any], json.loads(line[3:]))


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


def connection_count(address: tuple[str, int]) -> int:
    """Connections the server counts (including the one asking)."""
    return cast(int, stats(address)["connections"])


def release_behind_its_back(
    address: tuple[str, int], key: str, token: str, semaphore: bool = False
) -> None:
    """Release ``token`` from another connection (tokens are bearer credentials)."""
    encode = _requests.checked_sem_release if semaphore else checked_release
    assert raw_request(address, encode(key, token)) == b"ok"
