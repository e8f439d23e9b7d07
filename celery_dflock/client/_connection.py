"""The two transports a connection to a lock server owns (its byte side): a blocking socket
(`SocketTransport`) and an asyncio stream (`AsyncStreamTransport`). A transport sends a
request's bytes and reads its reply, says whether an idle connection is still sound, and
closes (in a forked child only dropping its copy of the socket).

A plain TCP `SocketTransport` keeps its socket non-blocking and waits with ``poll`` (three
system calls per request, where socket timeouts cost six); TLS uses socket timeouts."""

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

from celery_dflock.client._replies import Reply, ReplyParser
from celery_dflock.client._requests import Command
from celery_dflock.client._settings import Endpoint
from celery_dflock.client._watch import can_watch
from celery_dflock.client.errors import ServerUnavailable

__all__ = ["RECV_BYTES", "AsyncStreamTransport", "SocketTransport"]

RECV_BYTES: Final = 65536
_POLL_IN: Final = select.POLLIN if hasattr(select, "poll") else 0
_POLL_OUT: Final = select.POLLOUT if hasattr(select, "poll") else 0
_POLL_MAX_MS: Final = 86_400_000
"""The longest one ``poll`` waits (its milliseconds are a C int: about 24.8 days at most); a
longer wait polls again, its deadline deciding."""
_POLL_NVAL: Final = select.POLLNVAL if hasattr(select, "poll") else 0
_SHOWN_BYTES: Final = 40  # of bytes nobody asked for, shown in what an idle check saw


def unasked(data: bytes | bytearray, *, peeked: bool = False) -> str:
    """What an idle check says of bytes nobody asked for (their start); ``peeked``: ``data``
    is the start of what waits (`_SHOWN_BYTES` and one more, at most)."""
    count = f"over {_SHOWN_BYTES}" if peeked and len(data) > _SHOWN_BYTES else len(data)
    return f"{count} byte(s) nobody asked for ({bytes(data[:_SHOWN_BYTES])!r})"


def _peeked(sock: socket.socket, events: int) -> str:
    """What a readable idle socket holds (``poll`` ``events``), left unread: EOF, an error,
    or bytes nobody asked for."""
    if events & _POLL_NVAL:
        return "its descriptor is not open"
    try:
        data = sock.recv(_SHOWN_BYTES + 1, socket.MSG_PEEK)
    except BlockingIOError:
        return f"poll events {events:#x}, nothing to read"
    except OSError as exc:
        return f"a socket error ({exc})"
    return unasked(data, peeked=True) if data else "EOF from the peer"


def _closed_by_peer(endpoint: Endpoint, command: Command) -> ServerUnavailable:
    why = "restarted, shutting down, or an idle/auth timeout"
    if endpoint.ssl_context is None and command in (Command.HELLO, Command.AUTH):
        why = (  # a TLS server closes a plain connection at its first line
            "restarted, shutting down, an idle/auth timeout, or it requires TLS (started with "
            "--tls-cert): connect with TLS (ssl_context=...; in Celery the `dflock_ssl` setting)"
        )
    return ServerUnavailable(
        f"the lock server at {endpoint.address} closed the connection during "
        f"{command.label} ({why})"
    )


def _close_made_tls_socket(exc: BaseException) -> None:
    """Close the ``SSLSocket`` a failed ``wrap_socket`` made (CPython 3.11.5+ leaves it open
    on a reset before the handshake): it is the ``self`` of a traceback frame."""
    tb = exc.__traceback__
    while tb is not None:
        made = tb.tb_frame.f_locals.get("self")
        if isinstance(made, ssl.SSLSocket):
            made.close()
        tb = tb.tb_next


class SocketTransport:
    """A blocking connection's socket."""

    def __init__(self, endpoint: Endpoint, sock: socket.socket) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.parser = ReplyParser()
        self.pid = os.getpid()
        self.closed = False
        # Checked for reuse by a ``ping`` (TLS: a socket read would touch the TLS state).
        self.pings = isinstance(sock, ssl.SSLSocket)
        self._poller: select.poll | None = None
        if hasattr(select, "poll") and not isinstance(sock, ssl.SSLSocket):
            sock.setblocking(False)
            self._poller = select.poll()
            self._poller.register(sock, _POLL_IN)
        self.exchange: Callable[[Command, bytes, float], Reply] = (
            self._exchange_timeouts if self._poller is None else self._exchange_polling
        )

    @classmethod
    def open(cls, endpoint: Endpoint) -> SocketTransport:
        """Connect (bounded by ``connect_timeout_s``) and wrap in TLS."""
        try:
            sock = socket.create_connection(
                (endpoint.host, endpoint.port), timeout=endpoint.connect_timeout_s
            )
        except OSError as exc:
            raise endpoint.unavailable(exc) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.ssl_context is not None:
                sock = endpoint.ssl_context.wrap_socket(sock, server_hostname=endpoint.host)
        except OSError as exc:
            sock.close()
            _close_made_tls_socket(exc)
            raise endpoint.unavailable(f"TLS setup: {exc}") from exc
        return cls(endpoint, sock)

    def _exchange_timeouts(self, command: Command, data: bytes, timeout: float) -> Reply:
        deadline = time.monotonic() + timeout
        self.sock.settimeout(timeout)
        if data:
            self.sock.sendall(data)
        while (reply := self.parser.next_reply(command)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(RECV_BYTES)
            if not chunk:
                raise _closed_by_peer(self.endpoint, command)
            self.parser.feed(chunk)
        return reply

    def _exchange_polling(self, command: Command, data: bytes, timeout: float) -> Reply:
        # The parser's buffer is empty here: bytes left after a reply close the connection.
        deadline = time.monotonic() + timeout
        sock, parser, poller = self.sock, self.parser, self._poller
        assert poller is not None
        try:
            sent = sock.send(data) if data else 0
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._send_rest(poller, data, sent, deadline)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            try:
                ready = poller.poll(math.ceil(remaining * 1000))
            except OverflowError:  # a wait longer than poll counts (free of cost when none)
                ready = poller.poll(_POLL_MAX_MS)
            if not ready:
                continue  # woken early (rounding, a wait past _POLL_MAX_MS): the deadline decides
            try:
                chunk = sock.recv(RECV_BYTES)
            except BlockingIOError:
                continue  # a spurious wake-up: wait again
            if not chunk:
                raise _closed_by_peer(self.endpoint, command)
            if (reply := parser.feed_reply(command, chunk)) is not None:
                return reply

    def _send_rest(self, poller: select.poll, data: bytes, sent: int, deadline: float) -> None:
        """Send what the socket's buffer did not take at once (rare: requests are short)."""
        view = memoryview(data)[sent:]
        poller.modify(self.sock, _POLL_OUT)
        try:
            while view:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                # Writable, or an error `send` reports:
                if poller.poll(min(math.ceil(remaining * 1000), _POLL_MAX_MS)):
                    with contextlib.suppress(BlockingIOError):
                        view = view[self.sock.send(view) :]
        finally:
            poller.modify(self.sock, _POLL_IN)

    def at_eof(self) -> bool:
        """False: a blocking socket learns of an EOF only by reading (`quiet`)."""
        return False

    def quiet(self) -> bool:
        """Cheap liveness check of an idle connection: no EOF, nothing waiting to be read."""
        return self.unsound() is None

    def unsound(self) -> str | None:
        """What makes an idle connection unusable (EOF, an error, bytes nobody asked for, left
        unread), said for the logs; None when nothing waits to be read."""
        if isinstance(self.sock, ssl.SSLSocket):
            return self._tls_unsound(self.sock)
        if self._poller is not None:
            # Readable means EOF, an error, or bytes nobody asked for: not reusable.
            try:
                ready = self._poller.poll(0)
            except OSError as exc:
                return f"its socket could not be polled ({exc})"
            return _peeked(self.sock, ready[0][1]) if ready else None
        try:
            self.sock.settimeout(0.0)
            data = self.sock.recv(_SHOWN_BYTES + 1, socket.MSG_PEEK)
        except BlockingIOError:
            return None  # nothing to read: the peer has not closed it
        except OSError as exc:
            return f"a socket error ({exc})"
        return unasked(data, peeked=True) if data else "EOF from the peer"  # not reusable

    def _tls_unsound(self, sock: ssl.SSLSocket) -> str | None:
        """None when a TLS connection has nothing to read but TLS records (session tickets):
        a readable socket is read without blocking; unasked application bytes are kept in the
        reply parser and the connection refused for reuse."""
        if pending := sock.pending():
            return f"{pending} decrypted byte(s) nobody asked for"
        if hasattr(select, "poll"):
            try:
                poller = select.poll()
                poller.register(sock, _POLL_IN)
                if not poller.poll(0):
                    return None  # nothing arrived: the TLS state is not touched at all
            except (OSError, ValueError) as exc:
                return f"its socket could not be polled ({exc})"
        try:
            sock.settimeout(0.0)  # the next request sets its own timeout
            data = sock.recv(RECV_BYTES)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None  # only TLS records (or part of one): the peer has not closed it
        except (OSError, ValueError) as exc:
            return f"a socket error ({exc})"
        if data:
            self.parser.feed(data)  # bytes nobody asked for (the next request reports them)
            return unasked(data)
        return "EOF (or TLS close_notify) from the peer"

    def breakage(self, lock: threading.Lock) -> str | None:
        """`AsyncConnection.idle_breakage` (closed, or `unsound`); None when ``lock`` (the
        request lock) is taken."""
        if not lock.acquire(blocking=False):
            return None
        try:
            return "closed by this client" if self.closed else self.unsound()
        finally:
            lock.release()

    def watchable_fd(self) -> int | None:
        """The descriptor a `ConnectionWatcher` may poll (where it can poll), or None."""
        if self.closed or self.pid != os.getpid() or not can_watch():
            return None
        return self.sock.fileno()

    def half_close(self) -> bool:
        """Send EOF and keep reading (an interrupted acquire's reply still to come); False,
        doing nothing, over TLS (its close cannot be half)."""
        if isinstance(self.sock, ssl.SSLSocket):
            return False
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return False
        return True

    def close(self, *, abort: bool) -> None:
        """Close the socket (never ``shutdown``: a forked twin may share it). Idempotent."""
        del abort
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


class _StreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, also telling its watcher when bytes arrive, the peer
    half-closes or the connection is lost."""

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


class AsyncStreamTransport:
    """An asyncio connection's stream, the peer's close heard by its protocol."""

    def __init__(
        self,
        endpoint: Endpoint,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stream: _StreamProtocol,
    ) -> None:
        self.endpoint = endpoint
        self.parser = ReplyParser()
        self.pid = os.getpid()
        self.pings = True
        self._reader = reader
        self._writer = writer
        self._stream = stream

    @classmethod
    async def open(cls, endpoint: Endpoint) -> AsyncStreamTransport:
        """Connect (bounded by ``connect_timeout_s``), with TLS."""
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
            raise endpoint.unavailable(detail) from exc
        except OSError as exc:
            raise endpoint.unavailable(exc) from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(endpoint, reader, writer, stream)

    async def exchange(self, command: Command, data: bytes, timeout: float) -> Reply:
        """Send ``data`` (none: after `half_close`, the reply still to come) and read the reply
        to ``command`` within ``timeout`` s; the blocking transport's does the same."""
        async with asyncio.timeout(timeout):
            if data:
                self._writer.write(data)
                await self._writer.drain()
            while (reply := self.parser.next_reply(command)) is None:
                chunk = await self._reader.read(RECV_BYTES)
                if not chunk:
                    raise _closed_by_peer(self.endpoint, command)
                self.parser.feed(chunk)
        return reply

    def at_eof(self) -> bool:
        """True once the peer's EOF was seen, or the stream is closing."""
        return self._writer.is_closing() or self._reader.at_eof()

    def quiet(self) -> bool:
        """True when no EOF was seen and nothing waits on the socket (an idle connection's
        transport has read all there was: anything now is EOF or bytes nobody asked for)."""
        if self.at_eof():
            return False
        unread: object = getattr(self._reader, "_buffer", b"")  # read by the transport
        if isinstance(unread, bytes | bytearray) and unread:
            return False  # bytes nobody asked for
        sock = self._writer.get_extra_info("socket")
        if sock is None or not hasattr(select, "poll"):
            return True  # at_eof() is all we can know
        try:
            poller = select.poll()
            poller.register(sock.fileno(), _POLL_IN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def watch(self, callback: Callable[[], object] | None) -> None:
        """Call ``callback`` (synchronously, doing no I/O) whenever the peer sends bytes,
        half-closes or the connection is lost; None stops."""
        self._stream.on_peer = callback

    def breakage(self, lock: asyncio.Lock) -> str | None:
        """`AsyncConnection.idle_breakage` (nothing else runs on the loop meanwhile)."""
        del lock
        unread: object = getattr(self._reader, "_buffer", b"")  # read by the transport
        if isinstance(unread, bytes | bytearray) and unread:
            return unasked(unread)
        if (exc := self._reader.exception()) is not None:
            return f"a socket error ({exc})"
        if self._reader.at_eof():
            return "EOF from the peer"
        if self._writer.is_closing():
            return "closed by this client"
        if self._stream.peer_closed:
            return "EOF from the peer"
        return None

    def half_close(self) -> bool:
        """Send EOF and keep reading (an interrupted acquire's reply still to come); False,
        doing nothing, over TLS (its close cannot be half)."""
        writer = self._writer
        if self.pid != os.getpid() or writer.is_closing() or not writer.can_write_eof():
            return False
        writer.write_eof()
        return True

    def close(self, *, abort: bool) -> None:
        """Start closing (``abort``: dropping unsent data); in a forked child, drop our copy
        of the socket only."""
        if self.pid != os.getpid():
            self._drop_in_child()
        elif abort:
            self._writer.transport.abort()
        else:
            self._writer.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError, RuntimeError):
            await self._writer.wait_closed()

    def _drop_in_child(self) -> None:
        """In a forked child: point our descriptor at /dev/null, so the transport, when
        collected, closes that instead."""
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
