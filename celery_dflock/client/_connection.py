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
import time
from collections.abc import Callable
from typing import Final, Self

from celery_dflock.client._async.connection_ops import AsyncConnectionOps
from celery_dflock.client._servers import FEATURE_PING
from celery_dflock.client._settings import Endpoint
from celery_dflock.client._sync.connection_ops import ConnectionOps
from celery_dflock.client.errors import ServerUnavailable
from celery_dflock.client.protocol import Command, Reply

RECV_BYTES: Final = 65536
_POLL_IN: Final = select.POLLIN if hasattr(select, "poll") else 0
_POLL_OUT: Final = select.POLLOUT if hasattr(select, "poll") else 0


def _closed_by_peer(endpoint: Endpoint, command: Command) -> ServerUnavailable:
    return ServerUnavailable(
        f"the lock server at {endpoint.address} closed the connection during "
        f"{command.label} (restarted, shutting down, or an idle/auth timeout)"
    )


class Connection(ConnectionOps):
    """A blocking connection; thread safe (requests are serialized by a lock)."""

    def __init__(self, endpoint: Endpoint, sock: socket.socket) -> None:
        self._init_state(endpoint)
        self._sock = sock
        self._poller: select.poll | None = None
        if hasattr(select, "poll") and not isinstance(sock, ssl.SSLSocket):
            sock.setblocking(False)  # replies are waited for with poll (module docstring)
            self._poller = select.poll()
            self._poller.register(sock, _POLL_IN)

    @classmethod
    def open(cls, endpoint: Endpoint) -> Self:
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
        conn._authenticate()
        return conn

    def _exchange(self, command: Command, data: bytes, timeout: float) -> Reply:
        """Send ``data`` and read its reply (request lock held)."""
        deadline = time.monotonic() + timeout
        if self._poller is not None:
            return self._exchange_polling(command, data, deadline)
        return self._exchange_timeouts(command, data, timeout, deadline)

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

    _abort = close

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


class AsyncConnection(AsyncConnectionOps):
    """An asyncio connection; coroutine safe (requests are serialized by an asyncio lock)."""

    def __init__(
        self,
        endpoint: Endpoint,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stream: _StreamProtocol,
    ) -> None:
        self._init_state(endpoint)
        self._reader = reader
        self._writer = writer
        self._stream = stream

    @classmethod
    async def open(cls, endpoint: Endpoint) -> Self:
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
        await conn._authenticate()
        return conn

    async def _exchange(self, command: Command, data: bytes, timeout: float) -> Reply:
        """Send ``data`` and read its reply (request lock held)."""
        async with asyncio.timeout(timeout):
            self._writer.write(data)
            await self._writer.drain()
            while (reply := self._parser.next_reply(command)) is None:
                chunk = await self._reader.read(RECV_BYTES)
                if not chunk:
                    raise _closed_by_peer(self.endpoint, command)
                self._parser.feed(chunk)
        return reply

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
        self._shut(abort=True)

    def close(self) -> None:
        """Start closing (no await needed); idempotent."""
        self._shut(abort=False)

    def _shut(self, *, abort: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self.pid != os.getpid():
            self._drop_in_child()
        elif abort:
            self._writer.transport.abort()
        else:
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
