"""The connection pool, written once (see `celery_dflock.client.pool` for what a pool does).

The asyncio pool is written in ``celery_dflock/client/_async/pool.py``; the blocking one is
generated from it in ``_sync/`` by ``scripts/unasync.py``.
"""

from __future__ import annotations

from typing import Self

from celery_dflock.client._aio_backend import AsyncPoolBase
from celery_dflock.client._connection import AsyncConnection
from celery_dflock.client._settings import Endpoint

__all__ = ["AsyncConnectionPool"]


class AsyncConnectionPool(AsyncPoolBase):
    """Idle connections for the locks and semaphores of its kind (``pool=``).

    ``opened``, ``reused`` and ``discarded`` count connections opened, handed out again after
    a check, and dropped (dead, too old, or over ``max_idle_per_server``).
    """

    async def checkout(self, endpoint: Endpoint) -> AsyncConnection:
        """A verified idle connection to ``endpoint``, or a new one."""
        self._check()
        while (conn := self._take(endpoint)) is not None:
            if not self._store.too_old(conn) and await conn.is_reusable():
                self._count_reused()
                return conn
            await conn.aclose()
            self._count_discarded()
        conn = await self._open(endpoint)
        self._opened(conn, conn.server)
        return conn

    async def checkin(self, conn: AsyncConnection) -> None:
        """Give a connection back (closed, busy or foreign ones are dropped)."""
        self._check()
        if not self._keep(conn):
            await conn.aclose()

    async def aclose(self) -> None:
        """Close every idle connection (the pool stays usable)."""
        for conn in self._drain():
            await conn.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
