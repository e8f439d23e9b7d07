"""A pool's idle connections: the store per server, its counters, and forgetting them in a
fork child. The pools (`celery_dflock.client._async.pool`) each own an `IdleConnections`; what
each face adds is its `PoolFace` (`_aio_backend` / `_sync_backend`).
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


class _IdleStore(Generic[C]):
    """Idle lists per endpoint, the owner pid, counters."""

    def __init__(self, max_idle_per_server: int, max_idle_time_s: float) -> None:
        if isinstance(max_idle_per_server, bool) or not isinstance(max_idle_per_server, int):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"max_idle_per_server must be an int, got {max_idle_per_server!r}")
        if max_idle_per_server < 0:
            raise ValueError(f"max_idle_per_server must be >= 0, got {max_idle_per_server}")
        if not max_idle_time_s > 0:
            raise ValueError(f"max_idle_time_s must be > 0, got {max_idle_time_s!r}")
        self.max_idle_per_server = max_idle_per_server
        self.max_idle_time_s = float(max_idle_time_s)
        self.pid = os.getpid()
        self.idle: dict[Endpoint, list[C]] = {}
        self.servers: dict[Endpoint, ServerInfo] = {}
        """What each server answered to ``hello`` (asked once per server, kept across forks)."""
        self.opened = 0
        self.reused = 0
        self.discarded = 0

    def forked(self) -> list[C]:
        """In a new process: reset, returning the inherited idle connections to drop."""
        if self.pid == os.getpid():
            return []
        stale = [conn for conns in self.idle.values() for conn in conns]
        self.idle = {}
        self.pid = os.getpid()
        self.opened = self.reused = self.discarded = 0
        return stale

    def take(self, endpoint: Endpoint) -> C | None:
        """The most recently used idle connection to ``endpoint``, or None."""
        conns = self.idle.get(endpoint)
        return conns.pop() if conns else None

    def accepts(self, conn: C) -> bool:
        """True when ``conn`` may be kept idle (it is then stored)."""
        if conn.closed or conn.in_flight or conn.pid != self.pid:
            return False
        conns = self.idle.setdefault(conn.endpoint, [])
        if len(conns) >= self.max_idle_per_server:
            return False
        conns.append(conn)
        return True

    def drain(self) -> list[C]:
        conns = [conn for group in self.idle.values() for conn in group]
        self.idle = {}
        return conns

    def count(self, host: str | None, port: int | None) -> int:
        return sum(
            len(conns)
            for endpoint, conns in self.idle.items()
            if (host is None or endpoint.host == host) and (port is None or endpoint.port == port)
        )


class IdleConnections(Generic[C]):
    """The store, its mutex (the blocking pool is used from many threads; the asyncio one never
    holds it across an ``await``), fork handling and the counters, for both kinds of pool.
    ``forked`` is called when a fork child first uses it (after the inherited connections are
    dropped)."""

    def __init__(
        self, max_idle_per_server: int, max_idle_time_s: float, forked: Callable[[], None]
    ) -> None:
        self._store: _IdleStore[C] = _IdleStore(max_idle_per_server, max_idle_time_s)
        self._mutex = threading.Lock()
        self._forked = forked

    def check_fork(self) -> None:
        """In a fork child, the first time: drop the inherited connections."""
        if self._store.pid != os.getpid():
            self._mutex = threading.Lock()  # the parent's may have been held at fork time
            for conn in self._store.forked():
                conn.close()  # our copy of the descriptor only
            self._forked()

    def take(self, endpoint: Endpoint) -> C | None:
        """The most recently used idle connection to ``endpoint`` (unchecked), or None."""
        with self._mutex:
            return self._store.take(endpoint)

    def too_old(self, conn: C) -> bool:
        """True when ``conn`` was idle for longer than the server keeps an idle connection."""
        return time.monotonic() - conn.last_used > self._store.max_idle_time_s

    def known(self, endpoint: Endpoint) -> ServerInfo | None:
        """What the server at ``endpoint`` answered to ``hello`` (None: not asked yet)."""
        return self._store.servers.get(endpoint)

    def count_reused(self) -> None:
        with self._mutex:
            self._store.reused += 1

    def count_discarded(self) -> None:
        with self._mutex:
            self._store.discarded += 1

    def count_opened(self, conn: C, server: ServerInfo | None) -> None:
        """A connection opened for the pool's user; ``server``: what it said to ``hello``."""
        with self._mutex:
            self._store.opened += 1
            if server is not None:
                self._store.servers[conn.endpoint] = server

    def keep(self, conn: C) -> bool:
        """Store ``conn`` as idle; False (counted as discarded) when it may not be kept."""
        with self._mutex:
            kept = self._store.accepts(conn)
            if not kept:
                self._store.discarded += 1
        return kept

    def drain(self) -> list[C]:
        """Every idle connection, taken out (for the pool to close)."""
        self.check_fork()
        with self._mutex:
            return self._store.drain()

    def count(self, host: str | None = None, port: int | None = None) -> int:
        """Idle connections held (to ``host``/``port`` when given)."""
        self.check_fork()
        with self._mutex:
            return self._store.count(host, port)

    @property
    def opened(self) -> int:
        return self._store.opened

    @property
    def reused(self) -> int:
        return self._store.reused

    @property
    def discarded(self) -> int:
        return self._store.discarded

    def server_info(self, host: str, port: int) -> ServerInfo | None:
        for endpoint, info in list(self._store.servers.items()):
            if endpoint.host == host and endpoint.port == port:
                return info
        return None

    def describe(self) -> str:
        return (
            f"idle={self._store.count(None, None)} opened={self.opened} "
            f"reused={self.reused} discarded={self.discarded}"
        )
