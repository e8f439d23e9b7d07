"""A pool's idle connections per server, its counters, and forgetting them in a fork child.
The pools (`celery_dflock.client._async.pool`) each own an `IdleConnections`; what each face
adds is its `PoolFace` (`_aio_backend` / `_sync_backend`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Final, Generic, Protocol, TypeVar

from celery_dflock.client import wire
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._settings import READ_TIMEOUT_MARGIN_S, Endpoint

__all__ = ["DEFAULT_MAX_IDLE_PER_SERVER", "DEFAULT_MAX_IDLE_TIME_S", "IdleConnections"]

DEFAULT_MAX_IDLE_PER_SERVER: Final = 16
DEFAULT_MAX_IDLE_TIME_S: Final = wire.DEFAULT_READ_TIMEOUT_S - READ_TIMEOUT_MARGIN_S
"""Idle connections older than this are dropped: the server closes them at its read timeout."""


class _Pooled(Protocol):
    @property
    def endpoint(self) -> Endpoint: ...
    @property
    def pid(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def in_flight(self) -> bool: ...
    @property
    def last_used(self) -> float: ...
    def close(self) -> None: ...


C = TypeVar("C", bound=_Pooled)


class IdleConnections(Generic[C]):
    """Idle connections per endpoint, what each server said to ``hello``, and the counters,
    for both kinds of pool, under a mutex (the asyncio pool never holds it across an
    ``await``). ``forked`` is called when a fork child first uses it (after the inherited
    connections are dropped)."""

    def __init__(
        self, max_idle_per_server: int, max_idle_time_s: float, forked: Callable[[], None]
    ) -> None:
        if isinstance(max_idle_per_server, bool) or not isinstance(max_idle_per_server, int):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"max_idle_per_server must be an int, got {max_idle_per_server!r}")
        if max_idle_per_server < 0:
            raise ValueError(f"max_idle_per_server must be >= 0, got {max_idle_per_server}")
        if not max_idle_time_s > 0:
            raise ValueError(f"max_idle_time_s must be > 0, got {max_idle_time_s!r}")
        self._max_idle_per_server = max_idle_per_server
        self._max_idle_time_s = float(max_idle_time_s)
        self._pid = os.getpid()
        self._idle: dict[Endpoint, list[C]] = {}
        self.servers: dict[Endpoint, ServerInfo] = {}  # ``hello`` answers, kept across forks
        self._mutex = threading.Lock()
        self._forked = forked
        self.opened = 0
        self.reused = 0
        self.discarded = 0

    def check_fork(self) -> None:
        """In a fork child, the first time: drop the inherited connections."""
        if self._pid != os.getpid():
            self._mutex = threading.Lock()  # the parent's may have been held at fork time
            for conns in self._idle.values():
                for conn in conns:
                    conn.close()  # our copy of the descriptor only
            self._idle = {}
            self._pid = os.getpid()
            self.opened = self.reused = self.discarded = 0
            self._forked()

    def take(self, endpoint: Endpoint) -> C | None:
        """The most recently used idle connection to ``endpoint`` (unchecked), or None."""
        with self._mutex:
            conns = self._idle.get(endpoint)
            return conns.pop() if conns else None

    def too_old(self, conn: C) -> bool:
        """True when ``conn`` was idle for longer than the server keeps an idle connection."""
        return time.monotonic() - conn.last_used > self._max_idle_time_s

    def count_reused(self) -> None:
        with self._mutex:
            self.reused += 1

    def count_discarded(self) -> None:
        with self._mutex:
            self.discarded += 1

    def count_opened(self, conn: C, server: ServerInfo | None) -> None:
        with self._mutex:
            self.opened += 1
            if server is not None:
                self.servers[conn.endpoint] = server

    def keep(self, conn: C) -> bool:
        """Store ``conn`` as idle; False (counted as discarded) when it may not be kept."""
        with self._mutex:
            if not (conn.closed or conn.in_flight or conn.pid != self._pid):
                conns = self._idle.setdefault(conn.endpoint, [])
                if len(conns) < self._max_idle_per_server:
                    conns.append(conn)
                    return True
            self.discarded += 1
        return False

    def drain(self) -> list[C]:
        self.check_fork()
        with self._mutex:
            conns = [conn for group in self._idle.values() for conn in group]
            self._idle = {}
        return conns

    def count(self, host: str | None = None, port: int | None = None) -> int:
        self.check_fork()
        with self._mutex:
            return sum(
                len(conns)
                for endpoint, conns in self._idle.items()
                if (host is None or endpoint.host == host)
                and (port is None or endpoint.port == port)
            )

    def server_info(self, host: str, port: int) -> ServerInfo | None:
        for endpoint, info in list(self.servers.items()):
            if endpoint.host == host and endpoint.port == port:
                return info
        return None

    def describe(self) -> str:
        return (
            f"idle={sum(map(len, self._idle.values()))} opened={self.opened} "
            f"reused={self.reused} discarded={self.discarded}"
        )
