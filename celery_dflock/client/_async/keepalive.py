"""The keep-alive of a client session: one request every third of the session's time, whatever the
number of locks held on it (asyncio source of the ``_sync/`` twin: a task here, a thread there).

It runs while the session has held locks, on a connection of its own, closed when it ends. When the
server answers that it has no such session (or that a key of it is another cluster member's now), or
the deadline passes with no answer, the session is over: every lock held on it is told at once, and
its renewal reports the loss unless the server was found not running (an ``error_unavailable`` is
asked again). A server restarted without client sessions keeps none: the keep-alive stops, and
each lock renews its grant by token on a connection of its own."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Final

from celery_dflock.client._aio_backend import Background, background, pause
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._async.routing import Checkout
from celery_dflock.client._session import ClientSession
from celery_dflock.client._settings import MIN_RENEW_INTERVAL_S, REPLY_GRACE_S, Endpoint
from celery_dflock.client.errors import DflockError

__all__ = ["keep_session_alive", "start_keeping"]

RETRY_PAUSE_S: Final = 0.25


def start_keeping(session: ClientSession, endpoint: Endpoint, checkout: Checkout) -> Background:
    return background(
        lambda: keep_session_alive(session, endpoint, checkout),
        f"dflock-keepalive:{endpoint.address}",
    )


async def keep_session_alive(
    session: ClientSession, endpoint: Endpoint, checkout: Checkout
) -> None:
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
                # A connect may take no longer than the session has left: a stall outlasting
                # it ends the session here, and its locks are told, before the server's end.
                left = max(MIN_RENEW_INTERVAL_S, session.deadline() - now)
                within = replace(endpoint, connect_timeout_s=min(endpoint.connect_timeout_s, left))
                try:
                    conn = await checkout(within)
                except DflockError as exc:
                    if isinstance(exc.__cause__, ConnectionRefusedError):
                        session.refused()
                    await pause(RETRY_PAUSE_S)
                    continue
                if conn.session is None:
                    return  # its server restarted without client sessions: its locks renew
            left = session.deadline() - time.monotonic()
            timeout = max(MIN_RENEW_INTERVAL_S, min(REPLY_GRACE_S, left))
            kept = await conn.keep_alive(session, timeout)
            if kept is False:
                session.end(
                    "the server refused its keep-alive (no such session any more, or it may not "
                    "renew its grants: a key of it is another cluster member's, a journal it "
                    "cannot write)"
                )
                return
            if kept is None:  # the request closed the connection, or asked again later
                await pause(RETRY_PAUSE_S)
    finally:
        if not idle:  # (idle: counted as stopped already; another may have started)
            session.stopped()
        if conn is not None:
            conn.close()  # its own from now on: never given back (its pool may be closed)
