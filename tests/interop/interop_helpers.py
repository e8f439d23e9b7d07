"""What the interop tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import os
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
        self._spawn(self._pipe, back, front)
        self._pipe(front, back)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        _cut(src)
        _cut(dst)


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
