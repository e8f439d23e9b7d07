"""The keep-alive of a client session (docs/protocol.md, "Client sessions"): one request every
third of the session's time, whatever the number of locks held on it.

Written once for both faces: the asyncio source, ``celery_dflock/client/_async/keepalive.py``,
and the blocking twin that ``scripts/unasync.py`` generates from it in ``_sync/`` (there, a
thread of its own; here, a task of the running loop).

It runs while the session has held locks, on a connection of its own taken from the locks' pool
(or made as the lock's own are) and closed when it ends, once they are all let go: started again
by the next. Each
answered ``ping _ session <id>`` moves the session's deadline on. When the server answers that
it has no such session, or the deadline passes with no answer (the server, the network or this
process stalled longer than the session's time), the session is over: every lock held on it is
told at once (`celery_dflock.client._session.ClientSession.end`), and its renewal reports the
loss unless the server was found not running (a durable server that is not running ends
nothing: the locks reattach by token when it is back, within their leases).
"""

from __future__ import annotations

import time
from typing import Final

from celery_dflock.client._aio_backend import Background, background, pause
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._async.routing import Checkout
from celery_dflock.client._session import ClientSession
from celery_dflock.client._settings import MIN_RENEW_INTERVAL_S, REPLY_GRACE_S, Endpoint
from celery_dflock.client.errors import DflockError

__all__ = ["keep_session_alive", "start_keeping"]

RETRY_PAUSE_S: Final = 0.25
"""Between two attempts to reach the server again while the session's deadline still runs."""


def start_keeping(session: ClientSession, endpoint: Endpoint, checkout: Checkout) -> Background:
    """Start the keep-alive of ``session`` (with the server at ``endpoint``) beside the caller,
    on a connection from ``checkout`` (a pool's, or a lock's without one)."""
    return background(
        lambda: keep_session_alive(session, endpoint, checkout),
        f"dflock-keepalive:{endpoint.address}",
    )


async def keep_session_alive(
    session: ClientSession, endpoint: Endpoint, checkout: Checkout
) -> None:
    """Keep ``session`` alive while it has held locks (see the module's doc)."""
    conn: AsyncConnection | None = None
    idle = False
    try:
        while not (idle := session.idle()):
            if not session.live():
                return  # its deadline passed: over (its locks were told)
            now = time.monotonic()
            due = session.answered_at + session.interval()
            if now < due:
                await pause(due - now)
                continue
            if conn is None or conn.closed:
                try:
                    conn = await checkout(endpoint)
                except DflockError as exc:
                    if isinstance(exc.__cause__, ConnectionRefusedError):
                        session.refused()
                    await pause(RETRY_PAUSE_S)
                    continue
            left = session.deadline() - time.monotonic()
            timeout = max(MIN_RENEW_INTERVAL_S, min(REPLY_GRACE_S, left))
            kept = await conn.keep_alive(session, timeout)
            if kept is False:
                session.end("the server had no such session: it ended it, and its grants")
                return
            if kept is None:  # the request closed the connection
                await pause(RETRY_PAUSE_S)
    finally:
        if not idle:  # (idle: it counts as stopped already, and another may have started)
            session.stopped()
        if conn is not None:
            conn.close()  # its own from now on: never given back (its pool may be closed)
