"""What a connection does with requests, on top of its own I/O: authenticate, learn what the
server supports (``hello``), check it is alive (``ping``).

The I/O itself differs in substance between the blocking connection (a socket waited on with
``poll``) and the asyncio one (a stream protocol), so each is hand-written in
`celery_dflock.client._connection`; what they do with it is written once, in
``celery_dflock/client/_async/connection_ops.py``, and the blocking mixin is generated from it
in ``_sync/`` by ``scripts/unasync.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Self

from celery_dflock.client import protocol
from celery_dflock.client._servers import CLOSING_ERRORS, ServerInfo, auth_reply_error, server_info
from celery_dflock.client._settings import REPLY_GRACE_S, Endpoint
from celery_dflock.client.errors import DflockError, ProtocolError, ServerUnavailable
from celery_dflock.client.protocol import Command, ErrorReply, Reply, ReplyParser

__all__ = ["AsyncConnectionOps"]


def failure(endpoint: Endpoint, command: Command, exc: BaseException, timeout: float) -> Exception:
    """Translate an I/O failure during a request into the client's errors."""
    if isinstance(exc, TimeoutError):
        return ServerUnavailable(
            f"no reply from the lock server at {endpoint.address} to {command.label} within "
            f"{timeout:.1f}s; the connection was closed (is the server overloaded or hung?)"
        )
    if isinstance(exc, OSError):
        return ServerUnavailable(
            f"the connection to the lock server at {endpoint.address} failed during "
            f"{command.label} ({exc.strerror or exc}); locks held on it are released by "
            "the server"
        )
    return ServerUnavailable(f"connection to {endpoint.address} failed: {exc!r}")


def unsolicited(endpoint: Endpoint, parser: ReplyParser) -> ProtocolError:
    return ProtocolError(
        f"the lock server at {endpoint.address} sent {parser.buffered} byte(s) nobody asked "
        "for after a reply; the connection was closed"
    )


class AsyncConnectionOps:
    """Requests built on `request`; a connection class supplies the I/O."""

    endpoint: Endpoint
    server: ServerInfo | None
    """What the server said to ``hello`` (None: not asked on this connection)."""
    pid: int
    last_used: float
    _closed: bool
    _in_flight: bool
    _lock: asyncio.Lock
    _parser: ReplyParser

    def _init_state(self, endpoint: Endpoint) -> None:
        """The state every connection starts with (the fields of its own I/O are its
        class's)."""
        self.endpoint = endpoint
        self.pid = os.getpid()
        self.last_used = time.monotonic()
        self.server = None
        self._parser = ReplyParser()
        self._lock = asyncio.Lock()
        self._closed = False
        self._in_flight = False

    @classmethod
    async def open(cls, endpoint: Endpoint) -> Self:
        """Connect (bounded by ``connect_timeout_s``), with TLS, and authenticate."""
        raise NotImplementedError

    async def _exchange(self, command: Command, data: bytes, timeout: float) -> Reply:
        """Send ``data`` and read its reply (request lock held): the connection's own I/O."""
        raise NotImplementedError

    async def request(self, command: Command, data: bytes, timeout: float = REPLY_GRACE_S) -> Reply:
        """Send one request and return its decoded reply.

        Raises `ServerUnavailable` (the connection broke, or no reply within ``timeout``) or
        `ProtocolError`; in both cases, and if anything interrupts the call (a cancellation
        too), the connection is closed: a half-read reply would put later replies out of step.
        """
        if self.pid != os.getpid():
            raise DflockError(
                "this connection was opened by another process (before a fork); "
                "a forked child must open its own"
            )
        async with self._lock:
            if self._closed:
                raise ServerUnavailable(f"the connection to {self.endpoint.address} is closed")
            self._in_flight = True
            try:
                reply = await self._exchange(command, data, timeout)
                if self._parser.buffered:
                    raise unsolicited(self.endpoint, self._parser)
            except BaseException as exc:
                self._abort()
                if isinstance(exc, OSError):  # TimeoutError included
                    raise failure(self.endpoint, command, exc, timeout) from exc
                raise
            finally:
                self._in_flight = False
            if isinstance(reply, ErrorReply) and reply.code in CLOSING_ERRORS:
                self._abort()
            self.last_used = time.monotonic()
            return reply

    def _abort(self) -> None:
        """Close at once (used when a request cannot complete)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:  # unasync: async only
        raise NotImplementedError  # unasync: async only

    @classmethod
    async def connect(cls, endpoint: Endpoint, server: ServerInfo | None) -> Self:
        """`open`, knowing what the server supports: ``server`` when already known (a pool
        asks once per server), else ask ``hello`` first; a server with sessions is asked
        ``hello _ session`` on every new connection, which opts it in.

        A server that predates ``hello`` answers ``error`` (dflockd 0.4/0.5 then close the
        connection): that connection is dropped and a fresh one opened.
        """
        conn = await cls.open(endpoint)
        if server is None or server.session_ttl_s is not None:
            # Asked anew on each connection to a server with sessions: `hello _ session` makes
            # it a session connection (docs/protocol.md, "Tokens, leases and disconnects").
            try:
                server = await conn.hello()
            except BaseException:
                conn.close()
                raise
            if conn.closed:
                conn = await cls.open(endpoint)
        conn.server = server
        return conn

    async def _authenticate(self) -> None:
        """Send ``auth`` first when the endpoint has a token (a new connection)."""
        token = self.endpoint.auth_token
        if token is None:
            return
        try:
            reply = await self.request(Command.AUTH, protocol.encode_auth(token))
        except BaseException:
            await self.aclose()
            raise
        error = auth_reply_error(self.endpoint, reply)
        if error is not None:
            await self.aclose()
            raise error

    async def hello(self) -> ServerInfo:
        """Ask ``hello``; a server without it (`ServerInfo.legacy`) leaves this closed. Part of
        making a connection: its answer is waited for ``connect_timeout_s`` at most (cut to the
        lease left when a held lock reconnects)."""
        timeout = min(REPLY_GRACE_S, self.endpoint.connect_timeout_s)
        info = server_info(
            self.endpoint, await self.request(Command.HELLO, protocol.encode_hello(), timeout)
        )
        if info.legacy:
            self._abort()  # some close it after `error`: never reuse it
        return info

    async def shards(self) -> dict[str, object] | None:
        """Ask ``shards``: which keys the server serves (None: it does not know the request,
        an older or foreign server)."""
        reply = await self.request(Command.SHARDS, protocol.encode_shards())
        return reply.data if isinstance(reply, protocol.Shards) else None

    async def ping(self) -> bool:
        """True if the server answered ``ping``; on any failure the connection is closed."""
        try:
            reply = await self.request(Command.PING, protocol.encode_ping())
        except DflockError:
            self._abort()
            return False
        return isinstance(reply, protocol.Ok)

    @property
    def closed(self) -> bool:
        """True once closed (by us, by the peer, or by an interrupted request)."""
        return self._closed

    @property
    def in_flight(self) -> bool:
        """True while a request waits for its reply."""
        return self._in_flight

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.endpoint.address} {state}>"
