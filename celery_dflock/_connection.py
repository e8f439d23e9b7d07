"""Connections to a lock server: a blocking one (sockets) and an asyncio one (streams).

Both serialize requests (one in flight at a time, under a lock), send ``auth`` first when the
endpoint has a token, and close themselves when a request is interrupted midway (timeout,
exception, cancellation): a half-read reply would put every later reply out of step.
Neither is ever shut down from a forked child: the child only drops its copy of the socket.

A plain TCP `Connection` keeps its socket non-blocking and waits for replies with ``poll``
(send, poll, recv: three system calls per request, where a socket timeout costs six: two
``ioctl`` to set it and a ``poll`` before every send and receive). TLS sockets, and platforms
without ``poll``, use socket timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Final

from celery_dflock import protocol
from celery_dflock._core import (
    CLOSING_ERRORS,
    FEATURE_PING,
    REPLY_GRACE_S,
    Endpoint,
    ServerInfo,
    auth_reply_error,
    server_info,
)
from celery_dflock.errors import DflockError, ProtocolError, ServerUnavailable
from celery_dflock.protocol import Command, ErrorReply, Reply, ReplyParser

RECV_BYTES: Final = 65536
_POLL_IN: Final = select.POLLIN if hasattr(select, "poll") else 0
_POLL_OUT: Final = select.POLLOUT if hasattr(select, "poll") else 0


def _failure(endpoint: Endpoint, command: Command, exc: BaseException, timeout: float) -> Exception:
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


def _closed_by_peer(endpoint: Endpoint, command: Command) -> ServerUnavailable:
    return ServerUnavailable(
        f"the lock server at {endpoint.address} closed the connection during "
        f"{command.label} (restarted, shutting down, or an idle/auth timeout)"
    )


def _unsolicited(endpoint: Endpoint, parser: ReplyParser) -> ProtocolError:
    return ProtocolError(
        f"the lock server at {endpoint.address} sent {parser.buffered} byte(s) nobody asked "
        "for after a reply; the connection was closed"
    )


class Connection:
    """A blocking connection; thread safe (requests are serialized by a lock)."""

    def __init__(self, endpoint: Endpoint, sock: socket.socket) -> None:
        self.endpoint = endpoint
        self.pid = os.getpid()
        self.last_used = time.monotonic()
        self._sock = sock
        self._parser = ReplyParser()
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight = False
        self.server: ServerInfo | None = None
        """What the server said to ``hello`` (None: not asked on this connection)."""
        self._poller: select.poll | None = None
        if hasattr(select, "poll") and not isinstance(sock, ssl.SSLSocket):
            sock.setblocking(False)  # replies are waited for with poll (module docstring)
            self._poller = select.poll()
            self._poller.register(sock, _POLL_IN)

    @classmethod
    def open(cls, endpoint: Endpoint) -> Connection:
        """Connect (bounded by ``connect_timeout_s``), wrap in TLS, authenticate."""
        try:
            sock = socket.create_connection(
                (endpoint.host, endpoint.port), timeout=endpoint.connect_timeout_s
            )
        except OSError as exc:
            detail = exc.strerror or str(exc) or type(exc).__name__
            raise ServerUnavailable(endpoint.unavailable_message(detail)) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.ssl_context is not None:
                sock = endpoint.ssl_context.wrap_socket(sock, server_hostname=endpoint.host)
        except OSError as exc:
            sock.close()
            raise ServerUnavailable(endpoint.unavailable_message(f"TLS setup: {exc}")) from exc
        conn = cls(endpoint, sock)
        if endpoint.auth_token is not None:
            reply = conn.request(Command.AUTH, protocol.encode_auth(endpoint.auth_token))
            error = auth_reply_error(endpoint, reply)
            if error is not None:
                conn.close()
                raise error
        return conn

    @classmethod
    def connect(cls, endpoint: Endpoint, server: ServerInfo | None) -> Connection:
        """`open`, knowing what the server supports: ``server`` when already known (a pool
        asks once per server), else ask ``hello`` first.

        A server that predates ``hello`` answers ``error`` (dflockd 0.4/0.5 then close the
        connection): that connection is dropped and a fresh one opened.
        """
        conn = cls.open(endpoint)
        if server is None:
            try:
                server = conn.hello()
            except BaseException:
                conn.close()
                raise
            if conn.closed:
                conn = cls.open(endpoint)
        conn.server = server
        return conn

    def hello(self) -> ServerInfo:
        """Ask ``hello``; a server without it (`ServerInfo.legacy`) leaves this closed."""
        info = server_info(self.endpoint, self.request(Command.HELLO, protocol.encode_hello()))
        if info.legacy:
            self.close()  # some close it after `error`: never reuse it
        return info

    @property
    def closed(self) -> bool:
        """True once closed (by us, by the peer, or by an interrupted request)."""
        return self._closed

    @property
    def in_flight(self) -> bool:
        """True while a request waits for its reply."""
        return self._in_flight

    def request(self, command: Command, data: bytes, timeout: float = REPLY_GRACE_S) -> Reply:
        """Send one request and return its decoded reply.

        Raises `ServerUnavailable` (the connection broke, or no reply within ``timeout``) or
        `ProtocolError`; in both cases, and if anything interrupts the call, the connection is
        closed.
        """
        if self.pid != os.getpid():
            raise DflockError(
                "this connection was opened by another process (before a fork); "
                "a forked child must open its own"
            )
        with self._lock:
            if self._closed:
                raise ServerUnavailable(f"the connection to {self.endpoint.address} is closed")
            self._in_flight = True
            deadline = time.monotonic() + timeout
            try:
                if self._poller is not None:
                    reply = self._exchange_polling(command, data, deadline)
                else:
                    reply = self._exchange_timeouts(command, data, timeout, deadline)
                if self._parser.buffered:
                    raise _unsolicited(self.endpoint, self._parser)
            except BaseException as exc:
                self.close()
                if isinstance(exc, OSError):
                    raise _failure(self.endpoint, command, exc, timeout) from exc
                raise
            finally:
                self._in_flight = False
            if isinstance(reply, ErrorReply) and reply.code in CLOSING_ERRORS:
                self.close()
            self.last_used = time.monotonic()
            return reply

    def _exchange_timeouts(
        self, command: Command, data: bytes, timeout: float, deadline: float
    ) -> Reply:
        """Send ``data`` and read the reply with socket timeouts (TLS, or no ``poll``)."""
        self._sock.settimeout(timeout)
        self._sock.sendall(data)
        while (reply := self._parser.next_reply(command)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._sock.settimeout(remaining)
            chunk = self._sock.recv(RECV_BYTES)
            if not chunk:
                raise _closed_by_peer(self.endpoint, command)
            self._parser.feed(chunk)
        return reply

    def _exchange_polling(self, command: Command, data: bytes, deadline: float) -> Reply:
        """Send ``data`` and read the reply on the non-blocking socket, waiting with ``poll``."""
        # The parser's buffer is empty here: bytes left after a reply close the connection.
        sock, parser = self._sock, self._parser
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._send_rest(data, sent, deadline)
        poller = self._poller
        assert poller is not None
        while True:
            # (_wait(_POLL_IN, deadline), inlined: this runs for every request)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not poller.poll(math.ceil(remaining * 1000)):
                continue  # woken early by rounding: the deadline decides above
            try:
                chunk = sock.recv(RECV_BYTES)
            except BlockingIOError:
                continue  # a spurious wake-up: wait again
            if not chunk:
                raise _closed_by_peer(self.endpoint, command)
            if (reply := parser.feed_reply(command, chunk)) is not None:
                return reply

    def _send_rest(self, data: bytes, sent: int, deadline: float) -> None:
        """Send what the socket's buffer did not take at once (rare: requests are short)."""
        view = memoryview(data)[sent:]
        while view:
            self._wait(_POLL_OUT, deadline)
            try:
                view = view[self._sock.send(view) :]
            except BlockingIOError:
                continue

    def _wait(self, events: int, deadline: float) -> None:
        """Wait until the socket is ready for ``events``; `TimeoutError` at ``deadline``."""
        poller = self._poller
        assert poller is not None
        if events != _POLL_IN:
            poller.modify(self._sock, events)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                if poller.poll(math.ceil(remaining * 1000)):
                    return  # ready, or an error/hang-up the next send/recv reports
        finally:
            if events != _POLL_IN:
                poller.modify(self._sock, _POLL_IN)

    def ping(self) -> bool:
        """True if the server answered ``ping``; on any failure the connection is closed."""
        try:
            return isinstance(self.request(Command.PING, protocol.encode_ping()), protocol.Ok)
        except DflockError:
            self.close()
            return False

    def is_reusable(self) -> bool:
        """Cheap liveness check before reuse: a non-blocking peek (TLS: a ``ping`` where the
        server knows it, else a non-blocking read that only TLS records may satisfy)."""
        if self._closed or self.pid != os.getpid() or self._parser.buffered:
            return False
        if isinstance(self._sock, ssl.SSLSocket):
            if self.server is not None and self.server.supports(FEATURE_PING):
                return self.ping()
            return self._tls_quiet()
        if self._poller is not None:
            # Readable means EOF, an error, or bytes nobody asked for: not reusable.
            try:
                return not self._poller.poll(0)
            except OSError:
                return False
        try:
            self._sock.settimeout(0.0)
            data = self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read: the peer has not closed it
        except OSError:
            return False
        del data  # EOF (b"") or bytes nobody asked for: either way not reusable
        return False

    def _tls_quiet(self) -> bool:
        """True when a TLS connection has nothing to read but TLS records (session tickets):
        no application data, no close_notify, no EOF. Request lock held, no request in flight.

        A readable socket is read without blocking, which lets the TLS layer process what
        arrived: records that carry no application data (tickets) leave the stream in step for
        the next request; application bytes (nobody asked for them) are kept in the reply
        parser, never dropped, so the connection is refused for reuse either way."""
        sock = self._sock
        if not isinstance(sock, ssl.SSLSocket):  # pragma: no cover - TLS connections only
            return True
        if sock.pending():
            return False  # decrypted bytes nobody asked for
        if hasattr(select, "poll"):
            try:
                poller = select.poll()
                poller.register(sock, _POLL_IN)
                if not poller.poll(0):
                    return True  # nothing arrived: the TLS state is not touched at all
            except (OSError, ValueError):
                return False
        try:
            sock.settimeout(0.0)  # the next request sets its own timeout
            data = sock.recv(RECV_BYTES)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return True  # only TLS records (or part of one): the peer has not closed it
        except (OSError, ValueError):
            return False
        if data:
            self._parser.feed(data)  # bytes nobody asked for (the next request reports them)
        return False  # b"": EOF or close_notify

    def close(self) -> None:
        """Close the socket (never ``shutdown``: a forked twin may share it). Idempotent."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def watchable_fd(self) -> int | None:
        """The descriptor a `ConnectionWatcher` may poll (where ``poll`` exists), or None."""
        if self._closed or self.pid != os.getpid() or not hasattr(select, "poll"):
            return None
        return self._sock.fileno()

    def broken_while_idle(self) -> bool:
        """With no request in flight: True when the connection is unusable: EOF, a reset, a
        TLS close_notify, or bytes nobody asked for. False while a request is in flight (it
        sees a broken connection itself) and for TLS records that carry no data (tickets)."""
        if self._closed:
            return True
        if self._in_flight or not self._lock.acquire(blocking=False):
            return False  # never touch a connection a request is using
        try:
            if self._closed:
                return True
            if self._poller is not None:
                try:
                    return bool(self._poller.poll(0))
                except OSError:
                    return True
            if isinstance(self._sock, ssl.SSLSocket):
                return not self._tls_quiet()
            return False  # pragma: no cover - a plain socket without poll is never watched
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Connection {self.endpoint.address} {state}>"


class _StreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, also telling its connection's watcher (`AsyncConnection.watch`)
    when bytes arrive, the peer half-closes (EOF, or a TLS close_notify: the TLS layer consumes
    records that carry no data, such as session tickets, and reports a close as EOF) or the
    connection is lost. Nothing is read here that the stream reader does not get."""

    def __init__(self, reader: asyncio.StreamReader, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, loop=loop)
        self.on_peer: Callable[[], object] | None = None
        self.peer_closed = False

    def _tell(self) -> None:
        callback = self.on_peer
        if callback is not None:
            callback()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._tell()

    def eof_received(self) -> bool | None:
        self.peer_closed = True
        keep_open = super().eof_received()
        self._tell()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self.peer_closed = True
        super().connection_lost(exc)
        self._tell()


class AsyncConnection:
    """An asyncio connection; coroutine safe (requests are serialized by an asyncio lock)."""

    def __init__(
        self,
        endpoint: Endpoint,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stream: _StreamProtocol,
    ) -> None:
        self.endpoint = endpoint
        self.pid = os.getpid()
        self.last_used = time.monotonic()
        self._reader = reader
        self._writer = writer
        self._stream = stream
        self._parser = ReplyParser()
        self._lock = asyncio.Lock()
        self._closed = False
        self._in_flight = False
        self.server: ServerInfo | None = None
        """What the server said to ``hello`` (None: not asked on this connection)."""

    @classmethod
    async def open(cls, endpoint: Endpoint) -> AsyncConnection:
        """Connect (bounded by ``connect_timeout_s``), with TLS, and authenticate."""
        try:
            async with asyncio.timeout(endpoint.connect_timeout_s):
                # asyncio.open_connection, with a protocol that reports the peer's close.
                loop = asyncio.get_running_loop()
                reader = asyncio.StreamReader(loop=loop)
                stream = _StreamProtocol(reader, loop)
                transport, _ = await loop.create_connection(
                    lambda: stream,
                    endpoint.host,
                    endpoint.port,
                    ssl=endpoint.ssl_context,
                    server_hostname=endpoint.host if endpoint.ssl_context else None,
                )
                writer = asyncio.StreamWriter(transport, stream, reader, loop)
        except TimeoutError as exc:
            detail = f"no connection within {endpoint.connect_timeout_s}s"
            raise ServerUnavailable(endpoint.unavailable_message(detail)) from exc
        except OSError as exc:
            detail = exc.strerror or str(exc) or type(exc).__name__
            raise ServerUnavailable(endpoint.unavailable_message(detail)) from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = cls(endpoint, reader, writer, stream)
        if endpoint.auth_token is not None:
            try:
                reply = await conn.request(Command.AUTH, protocol.encode_auth(endpoint.auth_token))
            except BaseException:
                await conn.aclose()
                raise
            error = auth_reply_error(endpoint, reply)
            if error is not None:
                await conn.aclose()
                raise error
        return conn

    @classmethod
    async def connect(cls, endpoint: Endpoint, server: ServerInfo | None) -> AsyncConnection:
        """`open`, knowing what the server supports (see `Connection.connect`)."""
        conn = await cls.open(endpoint)
        if server is None:
            try:
                server = await conn.hello()
            except BaseException:
                conn.close()
                raise
            if conn.closed:
                conn = await cls.open(endpoint)
        conn.server = server
        return conn

    async def hello(self) -> ServerInfo:
        """Ask ``hello``; a server without it (`ServerInfo.legacy`) leaves this closed."""
        reply = await self.request(Command.HELLO, protocol.encode_hello())
        info = server_info(self.endpoint, reply)
        if info.legacy:
            self._abort()  # some close it after `error`: never reuse it
        return info

    @property
    def closed(self) -> bool:
        """True once closed (by us, by the peer, or by an interrupted request)."""
        return self._closed

    @property
    def in_flight(self) -> bool:
        """True while a request waits for its reply."""
        return self._in_flight

    async def request(self, command: Command, data: bytes, timeout: float = REPLY_GRACE_S) -> Reply:
        """Send one request and return its decoded reply (see `Connection.request`).

        Cancelling the calling task midway closes the connection.
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
                async with asyncio.timeout(timeout):
                    self._writer.write(data)
                    await self._writer.drain()
                    while (reply := self._parser.next_reply(command)) is None:
                        chunk = await self._reader.read(RECV_BYTES)
                        if not chunk:
                            raise _closed_by_peer(self.endpoint, command)
                        self._parser.feed(chunk)
                if self._parser.buffered:
                    raise _unsolicited(self.endpoint, self._parser)
            except BaseException as exc:
                self._abort()
                if isinstance(exc, OSError):  # TimeoutError included
                    raise _failure(self.endpoint, command, exc, timeout) from exc
                raise
            finally:
                self._in_flight = False
            if isinstance(reply, ErrorReply) and reply.code in CLOSING_ERRORS:
                self._abort()
            self.last_used = time.monotonic()
            return reply

    async def ping(self) -> bool:
        """True if the server answered ``ping``; on any failure the connection is closed."""
        try:
            reply = await self.request(Command.PING, protocol.encode_ping())
        except DflockError:
            self._abort()
            return False
        return isinstance(reply, protocol.Ok)

    async def is_reusable(self) -> bool:
        """Liveness check before reuse: not closed, no EOF seen, and a ``ping`` answered
        where the server knows it (else: nothing waiting to be read on the socket)."""
        if (
            self._closed
            or self.pid != os.getpid()
            or self._writer.is_closing()
            or self._reader.at_eof()
            or self._parser.buffered
        ):
            return False
        if self.server is not None and self.server.supports(FEATURE_PING):
            return await self.ping()
        return self._quiet()

    def _quiet(self) -> bool:
        """True when nothing is waiting on the socket: an idle connection's transport has
        read all there was, so anything now is EOF or bytes nobody asked for."""
        unread: object = getattr(self._reader, "_buffer", b"")  # read by the transport
        if isinstance(unread, bytes | bytearray) and unread:
            return False  # bytes nobody asked for
        sock = self._writer.get_extra_info("socket")
        if sock is None or not hasattr(select, "poll"):
            return True  # at_eof() above is all we can know
        try:
            poller = select.poll()
            poller.register(sock.fileno(), _POLL_IN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def watch(self, callback: Callable[[], object] | None) -> None:
        """Call ``callback`` (in the event loop, synchronously) whenever the peer sends bytes,
        half-closes or the connection is lost; None stops. Costs an attribute: the transport
        reports these events anyway. The callback must not do I/O on the connection: a
        request may be in flight (it only wakes whoever checks `broken_while_idle`)."""
        self._stream.on_peer = callback

    def broken_while_idle(self) -> bool:
        """With no request in flight: True when the connection is unusable (the peer closed
        it, it was lost, or bytes nobody asked for wait). False while a request is in flight:
        that request sees a broken connection itself."""
        if self._closed:
            return True
        if self._in_flight:
            return False
        unread: object = getattr(self._reader, "_buffer", b"")  # read by the transport
        return (
            self._reader.at_eof()
            or self._reader.exception() is not None
            or (isinstance(unread, bytes | bytearray) and bool(unread))
            or self._writer.is_closing()
            or self._stream.peer_closed
        )

    def _abort(self) -> None:
        """Close at once, dropping unsent data (used when a request cannot complete)."""
        if self._closed:
            return
        self._closed = True
        if self.pid != os.getpid():
            self._drop_in_child()
            return
        self._writer.transport.abort()

    def close(self) -> None:
        """Start closing (no await needed); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.pid != os.getpid():
            self._drop_in_child()
            return
        self._writer.close()

    async def aclose(self) -> None:
        """Close and wait until the transport is closed."""
        self.close()
        if self.pid == os.getpid():
            with contextlib.suppress(OSError, asyncio.CancelledError, RuntimeError):
                await self._writer.wait_closed()

    def _drop_in_child(self) -> None:
        """In a forked child: drop our copy of the socket without touching the parent's loop.

        The descriptor is pointed at /dev/null (closing our reference to the TCP connection),
        so the transport, when it is eventually collected, closes /dev/null instead.
        """
        sock = self._writer.get_extra_info("socket")
        if sock is None:
            return
        with contextlib.suppress(OSError, ValueError):
            fd = sock.fileno()
            if fd >= 0:
                null = os.open(os.devnull, os.O_RDWR)
                try:
                    os.dup2(null, fd)
                finally:
                    os.close(null)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<AsyncConnection {self.endpoint.address} {state}>"
