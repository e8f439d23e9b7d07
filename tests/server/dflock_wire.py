"""A minimal blocking line client for talking to the server byte by byte in tests, and a poll
for server state that no reply announces."""

from __future__ import annotations

import gc
import socket
import ssl
import time
import warnings
from collections.abc import Callable
from types import TracebackType

from dflockd_server.fence import fence_of

REPLY_TIMEOUT_S = 10.0


class Wire:
    """One raw connection: send frames, read reply lines (every read bounded by a timeout)."""

    def __init__(
        self,
        address: tuple[str, int],
        timeout: float = REPLY_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        raw = socket.create_connection(address, timeout=timeout)
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
        arg = f"{timeout}" if lease is None else f"{timeout} {lease}"
        reply = self.req("l", key, arg).split()
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


def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``check`` (server state no reply announces: queues, connection counts) until it
    holds, or fail saying ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def unclosed_after_gc() -> list[str]:
    """What a garbage collection finds left open (its ResourceWarnings): sockets and
    transports that whoever made them never closed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
