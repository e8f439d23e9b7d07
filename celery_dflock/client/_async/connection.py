"""A connection to a lock server: requests one at a time, each closing the connection when it cannot
complete; authenticating, ``hello``, ``ping``, and whether an idle one is still sound. The asyncio
source of the ``_sync/`` twin; each owns a transport (`celery_dflock.client._connection`), where the
two faces' I/O differs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Final, Self

from celery_dflock.client import _by_token, _replies, _requests, wire
from celery_dflock.client._background import background_task
from celery_dflock.client._connection import AsyncStreamTransport
from celery_dflock.client._replies import MAY_GRANT, ErrorReply, Granted, Queued, Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._servers import CLOSING_ERRORS, ServerInfo, auth_reply_error, server_info
from celery_dflock.client._session import ClientSession, Sessions
from celery_dflock.client._settings import REPLY_GRACE_S, Endpoint
from celery_dflock.client.errors import DflockError, ProtocolError, ServerUnavailable

__all__ = ["AsyncConnection"]

SEMAPHORE_GRANTING: Final = frozenset({Command.SEM_LOCK, Command.SEM_ENQUEUE, Command.SEM_WAIT})
ENQUEUING: Final = {Command.ENQUEUE: Command.WAIT, Command.SEM_ENQUEUE: Command.SEM_WAIT}
"""An enqueue, and the wait that collects its grant."""


def failure(endpoint: Endpoint, command: Command, exc: OSError, timeout: float) -> Exception:
    """Translate an I/O failure during a request (a timeout included) into the client's error."""
    if isinstance(exc, TimeoutError):
        return ServerUnavailable(
            f"no reply from the lock server at {endpoint.address} to {command.label} within "
            f"{timeout:.1f}s; the connection was closed (is the server overloaded or hung?)"
        )
    return ServerUnavailable(
        f"the connection to the lock server at {endpoint.address} failed during "
        f"{command.label} ({exc.strerror or exc})"
    )


class AsyncConnection:
    """A connection to one lock server; requests are serialized by a lock."""

    def __init__(self, endpoint: Endpoint, transport: AsyncStreamTransport) -> None:
        self.endpoint = endpoint
        self.pid = os.getpid()
        self.last_used = time.monotonic()
        self.server: ServerInfo | None = None  # its ``hello`` answer
        self.session: ClientSession | None = None  # the client session it joined
        self.sessions: Sessions | None = None  # whose current session it joins
        self.transport = transport
        self._parser = transport.parser
        self._lock = asyncio.Lock()
        self.closed = False
        self.in_flight = False
        self._reaper: object = None  # `_reap`'s task or thread, kept from collection

    @classmethod
    async def open(cls, endpoint: Endpoint) -> Self:
        """A connection to ``endpoint``, authenticated when it has an ``auth_token``."""
        conn = cls(endpoint, await AsyncStreamTransport.open(endpoint))
        token = endpoint.auth_token
        if token is not None:
            try:
                timeout = min(REPLY_GRACE_S, endpoint.connect_timeout_s)  # as `hello`'s
                reply = await conn.request(Command.AUTH, _requests.checked_auth(token), timeout)
                error = auth_reply_error(endpoint, reply)
                if error is not None:
                    raise error
            except BaseException:
                await conn.aclose()
                raise
        return conn

    async def request(self, command: Command, data: bytes, timeout: float = REPLY_GRACE_S) -> Reply:
        """Send one request and return its decoded reply. If it raises or is interrupted, the
        connection is closed: a half-read reply would put later replies out of step."""
        if self.pid != os.getpid():
            raise DflockError(
                "this connection was opened by another process (before a fork); "
                "a forked child must open its own"
            )
        async with self._lock:
            if self.closed:
                raise ServerUnavailable(f"the connection to {self.endpoint.address} is closed")
            self.in_flight = True
            try:
                reply = await self.transport.exchange(command, data, timeout)
                if self._parser.buffered:
                    raise ProtocolError(
                        f"the lock server at {self.endpoint.address} sent {self._parser.buffered}"
                        " byte(s) nobody asked for after a reply; the connection was closed"
                    )
            except BaseException as exc:
                # A failure, or a signal's exception (which, unlike a cancellation, may come
                # between a reply's read and its parse): a grant may be lost to its session.
                lost = isinstance(exc, Exception | KeyboardInterrupt | SystemExit)
                reap = isinstance(exc, TimeoutError) or not isinstance(exc, OSError | DflockError)
                unread = not lost or isinstance(exc, TimeoutError)  # its reply, for sure
                if not (reap and self._reap(command, data, timeout, unread=unread)):
                    self.close(abort=True)
                if lost and command in MAY_GRANT and self.session is not None:
                    self.session.retire()
                if isinstance(exc, OSError):  # TimeoutError included
                    raise failure(self.endpoint, command, exc, timeout) from exc
                raise
            finally:
                self.in_flight = False
            if isinstance(reply, ErrorReply) and reply.code in CLOSING_ERRORS:
                self.close(abort=True)
            self.last_used = time.monotonic()
            return reply

    def _reap(self, command: Command, data: bytes, timeout: float, *, unread: bool) -> bool:
        """An acquire interrupted (cancelled, a signal's exception) or unanswered in time on a
        session connection: a grant the server sent or sends later belongs to the session, which its
        keep-alives would keep for good with nobody knowing its token. Half-close (a grant made
        after the server sees EOF ends at once; a TLS close cannot be half, so there the wait runs
        its ``timeout``) and, in the background, read what is left and release a grant found in it,
        for the session's time at least: a server that answers later was stalled past it, so the
        session, and its grant, ended. False (no thread): nothing done, the caller closes."""
        session = self.session
        if command not in MAY_GRANT or session is None:
            return False
        # An enqueue is answered at once, but its place may be granted after its `queued`:
        # with that reply still to come, it is not half-closed, so that `_release_leftover`
        # can ask for that grant (`w 0`).
        ask = unread and command in ENQUEUING
        half = not ask and self.transport.half_close()
        wait_s = max(session.ttl, REPLY_GRACE_S if half else timeout)
        key = data.split(b"\n", 2)[1].decode()  # the request's key (checked when sent)
        try:
            self._reaper = background_task(
                lambda: self._release_leftover(command, key, wait_s, ask=ask), f"dflock-reap:{key}"
            )
        except RuntimeError:  # no thread (a process at its pid limit)
            return False
        self.closed = True
        return True

    async def _release_leftover(
        self, command: Command, key: str, wait_s: float, *, ask: bool
    ) -> None:
        """`_reap`'s background part: a grant in the reply still to come (within ``wait_s``)
        is released over a connection of its own, then this one is closed."""
        reply = None
        try:
            with contextlib.suppress(OSError, DflockError):  # EOF or no reply in time: none
                reply = await self.transport.exchange(command, b"", wait_s)
                if ask and isinstance(reply, Queued):  # granted since? `w 0` collects it
                    wait = ENQUEUING[command]
                    data = _requests.checked_wait(wait, key, 0)
                    reply = await self.transport.exchange(wait, data, REPLY_GRACE_S)
        finally:
            self.transport.close(abort=True)
        if not isinstance(reply, Granted):
            return
        semaphore = command in SEMAPHORE_GRANTING
        release = _by_token.release_request(key, reply.token, semaphore=semaphore)
        with contextlib.suppress(DflockError):  # else its session's time frees it
            conn = await type(self).open(self.endpoint)
            try:
                await conn.request(*release)
            finally:
                await conn.aclose()

    def close(self, *, abort: bool = False) -> None:
        """Start closing (no await needed; ``abort``: unsent bytes dropped); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.transport.close(abort=abort)

    async def aclose(self) -> None:  # unasync: async only
        """Close and wait until the transport is closed."""  # unasync: async only
        self.close()  # unasync: async only
        if self.pid == os.getpid():  # unasync: async only
            await self.transport.wait_closed()  # unasync: async only

    async def is_reusable(self, timeout: float = REPLY_GRACE_S) -> bool:
        """Liveness check before reuse: a ``ping`` (answered within ``timeout``) where the
        server knows it and the transport needs one, else nothing waiting to be read."""
        if self.closed or self.pid != os.getpid() or self._parser.buffered:
            return False
        transport, server = self.transport, self.server
        if transport.pings and server is not None and server.supports(wire.FEATURE_PING):
            timeout = min(REPLY_GRACE_S, timeout)
            return not transport.at_eof() and bool(await self.ping(timeout=timeout))
        return transport.quiet()

    def broken_while_idle(self) -> bool:
        """True when an idle connection is unusable (EOF, a reset, bytes nobody asked for);
        False while a request is in flight (it sees a broken connection itself)."""
        return self.idle_breakage() is not None

    def idle_breakage(self) -> str | None:
        """What makes an idle connection unusable (`broken_while_idle`), said for the logs:
        ``EOF from the peer``, a socket error, bytes nobody asked for, closed by this client;
        None while it is sound or a request is in flight."""
        if self.closed:
            return "closed by this client"
        return None if self.in_flight else self.transport.breakage(self._lock)

    @classmethod
    async def connect(
        cls, endpoint: Endpoint, server: ServerInfo | None, sessions: Sessions | None = None
    ) -> Self:
        """`open`, asking ``hello`` unless ``server`` is known, and joining the current client
        session of ``sessions`` on a server that keeps them. A server predating ``hello``
        (it answers ``error`` and may close): a fresh connection is opened."""
        conn = await cls.open(endpoint)
        joins = sessions is not None and server is not None and server.keeps_sessions
        try:
            if server is None or (server.session_ttl_s is not None and not joins):
                # Each connection to a server with connection sessions opts in with `hello`.
                server = await conn.hello()
                if conn.closed:
                    conn = await cls.open(endpoint)
            conn.server = server
            if sessions is not None and server.keeps_sessions:
                conn.sessions = sessions
                await conn.rejoin()
        except BaseException:
            conn.close()
            raise
        return conn

    async def rejoin(self) -> None:
        """Join the current session of its `Sessions`: on a server that let the one it was
        in run out, that one ends first, with its grants; else they come along."""
        sessions, server = self.sessions, self.server
        assert sessions is not None and server is not None  # joined in `connect`
        ttl = server.session_ttl(self.endpoint.session_ttl_s)
        await self.join(sessions.current(self.endpoint, ttl))

    async def join(self, session: ClientSession) -> None:
        """Join ``session`` (``hello _ session <id> <ttl>``), as a keep-alive does. A server
        restarted without client sessions (``--session-ttl 0``, an older version) answers as to
        ``hello``: the connection is in no session then."""
        reply, sent = await self._hello(_requests.encode_join_session(session.id, session.ttl))
        info = server_info(self.endpoint, reply, sent)  # raises for a refusal (auth, draining)
        if isinstance(reply, _replies.JsonReply):
            self.server = info  # this run's (a restart grace, its run)
            if not info.keeps_sessions:  # restarted without them: this connection is in none
                self.session = None
                if info.supports(wire.FEATURE_KEEPALIVE):
                    # It keeps them, but cut this one to a longest lease no keep-alive can keep
                    # (`ServerInfo.keeps_sessions`): ended at once, before anything is on it.
                    await self._hello(_requests.encode_join_session(session.id, 0))
                if info.session_ttl_s is not None:  # a session connection, as `connect` makes
                    self.server = await self.hello()
                return
            session.durable = info.supports(wire.FEATURE_DURABLE)
            session.run = info.run  # a restart: the grants of the run before are not renewed
            session.answered(sent)
            # The server keeps it at most its longest lease, which a restart may have lowered
            # since the session began: it is counted (and kept alive) at what the server keeps.
            session.ttl = info.session_ttl(session.ttl)
            self.session = session

    async def end_session(self, session: ClientSession) -> None:
        """End ``session`` now (``hello _ session <id> 0``); on a failure it ends by its time."""
        session.end("this client ended it")
        with contextlib.suppress(DflockError):
            await self._hello(_requests.encode_join_session(session.id, 0))

    async def keep_alive(self, session: ClientSession, timeout: float) -> bool | None:
        """``ping _ session <id>``: True kept, False refused (no such session, or a key of it
        not the member's any more), None not now: no answer (the connection is closed), or
        ``error_unavailable`` (a cluster member that cannot tell yet whether it serves the
        session's keys: asked again while the session runs)."""
        sent = time.monotonic()
        reply = await self._ping(_requests.encode_keepalive(session.id), timeout)
        if reply is None or (
            isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR_UNAVAILABLE
        ):
            return None
        if kept := isinstance(reply, _replies.Ok):
            session.answered(sent, renewed=True)
        return kept

    async def hello(self) -> ServerInfo:
        """Ask ``hello`` (within ``connect_timeout_s``); a server without it leaves this closed."""
        reply, sent = await self._hello(_requests.HELLO_REQUEST)
        info = server_info(self.endpoint, reply, sent)
        if info.legacy:
            self.close(abort=True)  # some close it after `error`: never reuse it
        return info

    async def learn_grace(self) -> None:
        """After an acquire timed out: a server without client sessions tells a restart's grace only
        in ``hello`` (no join answers), so it is asked again; a failure leaves what was known."""
        server = self.server
        if server is not None and not server.legacy and not server.keeps_sessions:
            with contextlib.suppress(DflockError):
                self.server = await self.hello()

    async def _hello(self, data: bytes) -> tuple[Reply, float]:
        """Send a ``hello`` request within ``connect_timeout_s``: its reply and send time."""
        timeout = min(REPLY_GRACE_S, self.endpoint.connect_timeout_s)
        sent = time.monotonic()
        return await self.request(Command.HELLO, data, timeout), sent

    async def shards(self) -> dict[str, object] | None:
        """Which keys the server serves (None: it does not know ``shards``)."""
        reply = await self.request(Command.SHARDS, _requests.SHARDS_REQUEST)
        return reply.data if isinstance(reply, _replies.JsonReply) else None

    async def ping(self, timeout: float = REPLY_GRACE_S) -> bool | None:
        """``ping``: True answered ``ok``, False refused, None no answer (the request closed it)."""
        reply = await self._ping(_requests.PING_REQUEST, timeout)
        return None if reply is None else isinstance(reply, _replies.Ok)

    async def _ping(self, data: bytes, timeout: float) -> Reply | None:
        """The reply to ``data``, a ping or keep-alive; None: no answer (the request closed it)."""
        try:
            return await self.request(Command.PING, data, timeout)
        except DflockError:
            return None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<{type(self).__name__} {self.endpoint.address} {state}>"
