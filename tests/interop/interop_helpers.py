"""What the interop tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[2]


def dflock_cli(servers: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A examples.proj dflock ARGS`` with ``DFLOCK_SERVERS=servers``."""
    env = {**os.environ, "DFLOCK_SERVERS": servers, "PYTHONPATH": str(ROOT),
           "CELERY_BROKER_URL": "memory://"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "examples.proj", "dflock", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@dataclass
class ForeignServer:
    """A real dflockd 0.5.0 server in a subprocess (no ping, stats, hello or fences)."""

    host: str
    port: int
    log: Path

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def connections_accepted(self) -> int:
        """Connections the server has accepted so far (it logs each one)."""
        return self.log.read_text().count("client connected")

    def connections_closed(self) -> int:
        """Connections the server has closed so far (it logs each one)."""
        return self.log.read_text().count("client closed")


PUMP_TIMEOUT_S = 10.0
PUMP_POLL_S = 0.2
"""A pump looks this often whether its sockets were closed under it (by ``__exit__``)."""


class TlsFront:
    """TLS in front of a plain server (as a TLS-terminating sidecar would be): each TLS
    connection is piped to a connection of its own to ``backend``; when either side closes,
    both are closed."""

    def __init__(self, backend: tuple[str, int], cert: str, key: str) -> None:
        self._backend = backend
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(cert, key)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._guard = threading.Lock()

    def __enter__(self) -> Self:
        self._spawn(self._accept_loop)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._listener.close()
        with self._guard:
            for sock in self._open:
                _cut(sock)
        for thread in self._threads:
            thread.join(10)

    def _spawn(self, target: Callable[..., object], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._spawn(self._serve, raw)

    def _serve(self, raw: socket.socket) -> None:
        try:
            front = self._context.wrap_socket(raw, server_side=True)
            back = socket.create_connection(self._backend)
        except OSError:
            raw.close()
            return
        with self._guard:
            self._open.update((front, back))
        self._pump(front, back)

    @staticmethod
    def _pump(front: ssl.SSLSocket, back: socket.socket) -> None:
        """Move bytes both ways from this one thread: an SSL socket must not be read in one
        thread while another writes it (OpenSSL then fails the connection now and then with
        "unexpected message")."""
        front.settimeout(PUMP_TIMEOUT_S)  # a recv never waits forever for a partial record
        back.settimeout(PUMP_TIMEOUT_S)
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed by __exit__
            while True:
                readable = [front] if front.pending() else []
                while not readable:
                    readable, _, _ = select.select([front, back], [], [], PUMP_POLL_S)
                for src, dst in ((front, back), (back, front)):
                    if src in readable:
                        data = src.recv(65536)
                        if not data:
                            raise ConnectionResetError  # one side closed: close both
                        dst.sendall(data)
        _cut(front)
        _cut(back)


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
