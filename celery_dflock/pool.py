"""Pools of idle connections to lock servers, one pool object per owner and process.

A lock borrows a connection when it acquires, pins it while held (the server releases a
connection's locks when it closes), and gives it back after releasing. The pool keeps idle
connections per server (``host``, ``port``, auth token and TLS context), checks each before
reuse, and drops ones idle for longer than the server would keep them. It asks each server
``hello`` once, to learn what it supports: the liveness check uses ``ping`` only where the
server knows it, and locks report ``fence`` only where the server issues fencing tokens.

Pools are fork safe: a pool records the pid that created it; used in another process (a forked
child) it forgets the inherited connections, closing only its own copies of their sockets (never
``shutdown``, which would cut the parent's connection), and opens new ones.

A blocking pool also carries the `Renewer` that renews the leases of the locks using it, so
a process renews all of them from one long-lived thread instead of a thread per grant.

Nothing here is global: whoever wants pooling creates a pool and passes it as ``pool=`` to
the locks (the Celery integration keeps one per app and process). Without a pool, each lock
opens its own connection and closes it on release.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Final, Generic, Protocol, Self, TypeVar

from celery_dflock._connection import AsyncConnection, Connection
from celery_dflock._core import READ_TIMEOUT_MARGIN_S, Endpoint, ServerInfo
from celery_dflock._renewal import Renewer
from celery_dflock.errors import DflockError
from dflockd_server import constants

__all__ = ["AsyncConnectionPool", "ConnectionPool"]

DEFAULT_MAX_IDLE_PER_SERVER: Final = 16
DEFAULT_MAX_IDLE_TIME_S: Final = constants.DEFAULT_READ_TIMEOUT_S - READ_TIMEOUT_MARGIN_S
"""Idle connections older than this are dropped: the server closes them at its read timeout."""
RENEWAL_LINGER_S: Final = 30.0
"""A pool's renewal thread exits after this long with nothing to renew (it restarts on demand)."""


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


C = TypeVar("C", bound=_Pooled)


class _IdleStore(Generic[C]):
    """The bookkeeping both pools share: idle lists per endpoint, the owner pid, counters."""

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

    def too_old(self, conn: C) -> bool:
        return time.monotonic() - conn.last_used > self.max_idle_time_s

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


class ConnectionPool:
    """Idle blocking connections for `DistributedLock` / `DistributedSemaphore` (``pool=``).

    Thread safe. ``opened``, ``reused`` and ``discarded`` count connections opened, handed out
    again after a check, and dropped (dead, too old, or over ``max_idle_per_server``).
    """

    def __init__(
        self,
        *,
        max_idle_per_server: int = DEFAULT_MAX_IDLE_PER_SERVER,
        max_idle_time_s: float = DEFAULT_MAX_IDLE_TIME_S,
    ) -> None:
        self._store: _IdleStore[Connection] = _IdleStore(max_idle_per_server, max_idle_time_s)
        self._lock = threading.Lock()
        self._renewer = Renewer(linger_s=RENEWAL_LINGER_S)

    @property
    def renewer(self) -> Renewer:
        """Renews the leases of every lock using this pool, from one long-lived thread (more
        only while a renewal is stuck on a slow server); fork safe like the pool."""
        return self._renewer

    def _check_fork(self) -> None:
        if self._store.pid != os.getpid():
            self._lock = threading.Lock()  # the parent's may have been held at fork time
            for conn in self._store.forked():
                conn.close()  # our copy of the descriptor only

    def checkout(self, endpoint: Endpoint) -> Connection:
        """A verified idle connection to ``endpoint``, or a new one."""
        self._check_fork()
        while True:
            with self._lock:
                conn = self._store.take(endpoint)
            if conn is None:
                break
            if not self._store.too_old(conn) and conn.is_reusable():
                with self._lock:
                    self._store.reused += 1
                return conn
            conn.close()
            with self._lock:
                self._store.discarded += 1
        conn = Connection.connect(endpoint, self._store.servers.get(endpoint))
        with self._lock:
            self._store.opened += 1
            if conn.server is not None:
                self._store.servers[endpoint] = conn.server
        return conn

    def checkin(self, conn: Connection) -> None:
        """Give a connection back (closed, busy or foreign ones are dropped)."""
        self._check_fork()
        with self._lock:
            kept = self._store.accepts(conn)
            if not kept:
                self._store.discarded += 1
        if not kept:
            conn.close()

    def idle_count(self, host: str | None = None, port: int | None = None) -> int:
        """Idle connections held (to ``host``/``port`` when given)."""
        self._check_fork()
        with self._lock:
            return self._store.count(host, port)

    @property
    def opened(self) -> int:
        """Connections this pool opened (in this process) and handed out. (The first
        connection to a server without ``hello`` costs one more, closed at once.)"""
        return self._store.opened

    def server_info(self, host: str, port: int) -> ServerInfo | None:
        """What the server at ``host:port`` answered to ``hello`` (None: not asked yet)."""
        for endpoint, info in list(self._store.servers.items()):
            if endpoint.host == host and endpoint.port == port:
                return info
        return None

    @property
    def reused(self) -> int:
        """Idle connections handed out again after passing the liveness check."""
        return self._store.reused

    @property
    def discarded(self) -> int:
        """Connections dropped instead of kept."""
        return self._store.discarded

    def close(self) -> None:
        """Close every idle connection (the pool stays usable)."""
        self._check_fork()
        with self._lock:
            conns = self._store.drain()
        for conn in conns:
            conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<ConnectionPool idle={self._store.count(None, None)} opened={self.opened} "
            f"reused={self.reused} discarded={self.discarded}>"
        )


class AsyncConnectionPool:
    """Idle asyncio connections for `AsyncDistributedLock` / `AsyncDistributedSemaphore`.

    Belongs to the event loop it is first used in (asyncio connections cannot move between
    loops); create one per loop. Reuse is checked with a ``ping`` where the server knows it.
    """

    def __init__(
        self,
        *,
        max_idle_per_server: int = DEFAULT_MAX_IDLE_PER_SERVER,
        max_idle_time_s: float = DEFAULT_MAX_IDLE_TIME_S,
    ) -> None:
        self._store: _IdleStore[AsyncConnection] = _IdleStore(max_idle_per_server, max_idle_time_s)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check_fork(self) -> None:
        if self._store.pid != os.getpid():
            for conn in self._store.forked():
                conn.close()  # in a child this only drops our descriptor
            self._loop = None

    def _check(self) -> None:
        self._check_fork()
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise DflockError(
                "this AsyncConnectionPool belongs to another event loop; "
                "create one pool per event loop"
            )

    async def checkout(self, endpoint: Endpoint) -> AsyncConnection:
        """A verified idle connection to ``endpoint``, or a new one."""
        self._check()
        while (conn := self._store.take(endpoint)) is not None:
            if not self._store.too_old(conn) and await conn.is_reusable():
                self._store.reused += 1
                return conn
            await conn.aclose()
            self._store.discarded += 1
        conn = await AsyncConnection.connect(endpoint, self._store.servers.get(endpoint))
        self._store.opened += 1
        if conn.server is not None:
            self._store.servers[endpoint] = conn.server
        return conn

    async def checkin(self, conn: AsyncConnection) -> None:
        """Give a connection back (closed, busy or foreign ones are dropped)."""
        self._check()
        if not self._store.accepts(conn):
            self._store.discarded += 1
            await conn.aclose()

    def idle_count(self, host: str | None = None, port: int | None = None) -> int:
        """Idle connections held (to ``host``/``port`` when given)."""
        self._check_fork()
        return self._store.count(host, port)

    @property
    def opened(self) -> int:
        """Connections this pool opened (in this process) and handed out. (The first
        connection to a server without ``hello`` costs one more, closed at once.)"""
        return self._store.opened

    def server_info(self, host: str, port: int) -> ServerInfo | None:
        """What the server at ``host:port`` answered to ``hello`` (None: not asked yet)."""
        for endpoint, info in list(self._store.servers.items()):
            if endpoint.host == host and endpoint.port == port:
                return info
        return None

    @property
    def reused(self) -> int:
        """Idle connections handed out again after passing the liveness check."""
        return self._store.reused

    @property
    def discarded(self) -> int:
        """Connections dropped instead of kept."""
        return self._store.discarded

    async def aclose(self) -> None:
        """Close every idle connection (the pool stays usable)."""
        self._check_fork()
        for conn in self._store.drain():
            await conn.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"<AsyncConnectionPool idle={self._store.count(None, None)} opened={self.opened} "
            f"reused={self.reused} discarded={self.discarded}>"
        )
