"""The connection pool (see `celery_dflock.client.pool`), asyncio source of the ``_sync/``
twin. It owns its idle connections (`celery_dflock.client._pooling.IdleConnections`) and what
its kind adds (its `PoolFace`: an asyncio pool's event loop, a blocking one's renewer).
"""

from __future__ import annotations

from typing import Self

from celery_dflock.client._aio_backend import AsyncPoolFace, PoolRenewer
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._pooling import (
    DEFAULT_MAX_IDLE_PER_SERVER,
    DEFAULT_MAX_IDLE_TIME_S,
    IdleConnections,
)
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._session import Sessions
from celery_dflock.client._settings import Endpoint

__all__ = ["AsyncConnectionPool"]


class AsyncConnectionPool:
    """Idle connections for the locks and semaphores of its kind (``pool=``).

    ``opened``, ``reused`` and ``discarded`` count connections opened, handed out again after
    a check, and dropped (dead, too old, or over ``max_idle_per_server``).
    """

    def __init__(
        self,
        *,
        max_idle_per_server: int = DEFAULT_MAX_IDLE_PER_SERVER,
        max_idle_time_s: float = DEFAULT_MAX_IDLE_TIME_S,
    ) -> None:
        face = self._face = AsyncPoolFace()
        self._idle: IdleConnections[AsyncConnection] = IdleConnections(
            max_idle_per_server, max_idle_time_s, face.forked
        )
        self._sessions = Sessions()  # this process's client session with each server

    async def checkout(self, endpoint: Endpoint) -> AsyncConnection:
        """A verified idle connection to ``endpoint``, or a new one."""
        idle = self._idle
        idle.check_fork()
        self._face.check()
        while (conn := idle.take(endpoint)) is not None:
            session = conn.session
            if (
                not idle.too_old(conn)
                and (session is None or session.live())
                and await conn.is_reusable()
            ):
                idle.count_reused()
                return conn
            await conn.aclose()
            idle.count_discarded()
        conn = await AsyncConnection.connect(endpoint, idle.servers.get(endpoint), self._sessions)
        idle.count_opened(conn, conn.server)
        return conn

    async def checkin(self, conn: AsyncConnection) -> None:
        """Give a connection back (closed, busy or foreign ones are dropped)."""
        self._idle.check_fork()
        self._face.check()
        if not self._idle.keep(conn):
            await conn.aclose()

    async def aclose(self) -> None:
        """Close every idle connection (the pool stays usable), having ended each client
        session that holds no lock of this process (a clean close lets go at once)."""
        idle = self._idle
        idle.check_fork()
        for endpoint, session in self._sessions.unheld():
            conn = idle.take(endpoint)
            if conn is not None:
                await conn.end_session(session)
                await conn.aclose()
        for conn in idle.drain():
            await conn.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def idle_count(self, host: str | None = None, port: int | None = None) -> int:
        """Idle connections held (to ``host``/``port`` when given)."""
        return self._idle.count(host, port)

    @property
    def opened(self) -> int:
        """Connections this pool opened (in this process) and handed out. (The first
        connection to a server without ``hello`` costs one more, closed at once.)"""
        return self._idle.opened

    @property
    def reused(self) -> int:
        """Idle connections handed out again after passing the liveness check."""
        return self._idle.reused

    @property
    def discarded(self) -> int:
        """Connections dropped instead of kept."""
        return self._idle.discarded

    def server_info(self, host: str, port: int) -> ServerInfo | None:
        """What the server at ``host:port`` answered to ``hello`` (None: not asked yet)."""
        return self._idle.server_info(host, port)

    @property
    def _renewer(self) -> PoolRenewer:
        """Renews the leases of every lock using this pool, from one long-lived thread (more
        only while a renewal is stuck); public on the blocking pool only."""
        return self._face.renewer

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._idle.describe()}>"
