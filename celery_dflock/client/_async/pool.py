"""The connection pool (see `celery_dflock.client.pool`), asyncio source of the ``_sync/`` twin. It
owns its idle connections, what each server said to ``hello``, its counters, and what its kind adds
(its `PoolFace`: an asyncio pool's event loop, a blocking one's renewer)."""

from __future__ import annotations

import os
import threading
import time
from typing import Final, Self

from celery_dflock.client import wire
from celery_dflock.client._aio_backend import AsyncPoolFace, PoolRenewer
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._session import Sessions
from celery_dflock.client._settings import READ_TIMEOUT_MARGIN_S, Endpoint, positive_seconds
from celery_dflock.client.errors import InvalidValueError

__all__ = ["DEFAULT_MAX_IDLE_PER_SERVER", "DEFAULT_MAX_IDLE_TIME_S", "AsyncConnectionPool"]

DEFAULT_MAX_IDLE_PER_SERVER: Final = 16
DEFAULT_MAX_IDLE_TIME_S: Final = wire.DEFAULT_READ_TIMEOUT_S - READ_TIMEOUT_MARGIN_S
"""Idle connections older than this are dropped: the server closes them at its read timeout."""


class AsyncConnectionPool:
    """Idle connections for the locks and semaphores of its kind (``pool=``).

    ``opened``, ``reused`` and ``discarded`` count connections opened, handed out again after the
    liveness check, and dropped (dead, too old, or over ``max_idle_per_server``), in this process.
    (The first connection to a server without ``hello`` costs one more, closed at once, which
    ``opened`` does not count.) The idle connections and counters are under a mutex (an asyncio pool
    never holds it across an ``await``)."""

    def __init__(
        self,
        *,
        max_idle_per_server: int = DEFAULT_MAX_IDLE_PER_SERVER,
        max_idle_time_s: float = DEFAULT_MAX_IDLE_TIME_S,
    ) -> None:
        if (
            isinstance(max_idle_per_server, bool)
            or not isinstance(max_idle_per_server, int)  # pyright: ignore[reportUnnecessaryIsInstance]
            or max_idle_per_server < 0
        ):
            raise InvalidValueError(
                f"max_idle_per_server must be an int >= 0, got {max_idle_per_server!r}"
            )
        self._max_idle_per_server = max_idle_per_server
        self._max_idle_time_s = positive_seconds("max_idle_time_s", max_idle_time_s)
        self._face = AsyncPoolFace()
        self._sessions = Sessions()  # this process's client session with each server
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._idle: dict[Endpoint, list[AsyncConnection]] = {}
        self._servers: dict[Endpoint, ServerInfo] = {}  # ``hello`` answers, kept across forks
        self.opened = 0
        self.reused = 0
        self.discarded = 0

    def _check_fork(self) -> None:
        """In a fork child, the first time: drop the inherited connections."""
        if self._pid != os.getpid():
            self._mutex = threading.Lock()  # the parent's may have been held at fork time
            for conns in self._idle.values():
                for conn in conns:
                    conn.close()  # our copy of the descriptor only
            self._idle = {}
            self._pid = os.getpid()
            self.opened = self.reused = self.discarded = 0
            self._face.forked()

    def _take(self, endpoint: Endpoint) -> AsyncConnection | None:
        """The most recently used idle connection to ``endpoint`` (unchecked), or None."""
        with self._mutex:
            conns = self._idle.get(endpoint)
            return conns.pop() if conns else None

    async def checkout(self, endpoint: Endpoint) -> AsyncConnection:
        """A verified idle connection to ``endpoint``, or a new one."""
        self._check_fork()
        self._face.check()
        while (conn := self._take(endpoint)) is not None:
            session = conn.session
            if (
                time.monotonic() - conn.last_used <= self._max_idle_time_s
                and (session is None or session.joinable())
                and await conn.is_reusable(endpoint.connect_timeout_s)  # as a new one's
            ):
                with self._mutex:
                    self.reused += 1
                return conn
            await conn.aclose()
            with self._mutex:
                self.discarded += 1
        conn = await AsyncConnection.connect(endpoint, self._servers.get(endpoint), self._sessions)
        with self._mutex:
            self.opened += 1
            if conn.server is not None:
                self._servers[endpoint] = conn.server
        return conn

    @property
    def sessions(self) -> Sessions:
        self._check_fork()
        return self._sessions

    async def checkin(self, conn: AsyncConnection) -> None:
        """Give a connection back (closed, busy or foreign ones are dropped)."""
        self._check_fork()
        self._face.check()
        with self._mutex:
            if not (conn.closed or conn.in_flight or conn.pid != self._pid):
                conns = self._idle.setdefault(conn.endpoint, [])
                if len(conns) < self._max_idle_per_server:
                    conns.append(conn)
                    return
            self.discarded += 1
        await conn.aclose()

    async def aclose(self) -> None:
        """Close every idle connection (the pool stays usable), having ended each client
        session that holds no lock of this process (a clean close lets go at once)."""
        self._check_fork()
        self._face.check(bind=False)  # (asyncio: its connections are its loop's; binds none)
        for endpoint, session in self._sessions.unheld():
            conn = self._take(endpoint)
            if conn is not None:
                await conn.end_session(session)
                await conn.aclose()
        with self._mutex:
            conns = [conn for group in self._idle.values() for conn in group]
            self._idle = {}
        for conn in conns:
            await conn.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def server_info(self, host: str, port: int) -> ServerInfo | None:
        """What the server at ``host:port`` answered to ``hello`` (None: not asked yet)."""
        for endpoint, info in list(self._servers.items()):
            if endpoint.host == host and endpoint.port == port:
                return info
        return None

    @property
    def _renewer(self) -> PoolRenewer:
        """Renews the leases of every lock using this pool, from one long-lived thread (more
        only while a renewal is stuck); public on the blocking pool only."""
        return self._face.renewer

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} idle={sum(map(len, self._idle.values()))} "
            f"opened={self.opened} reused={self.reused} discarded={self.discarded}>"
        )
