"""A plain TCP connection's transport on the server's own asyncio loop, compiled with the
request path.

asyncio's selector loop reads and writes a connection in Python (its socket transport's
``_read_ready``, ``_read_ready__data_received``, ``write``, ``is_closing``): on the compiled
server that was about a tenth of its CPU per request on asyncio's loop (benchmarks.
profile_server), and most of what set it apart from uvloop's transport, which is C.
``SocketTransport`` does what asyncio's socket transport does for a plain ``asyncio.Protocol``
(CPython 3.11's, step for step: one read of at most ``MAX_READ`` bytes per readiness; a write
sent at once while nothing is buffered, else buffered and sent when the socket is writable;
the protocol paused above the high-water mark and resumed at the low one; ``close`` after the
buffer drains, ``abort`` at once; ``connection_lost`` called soon after, once), compiled.

``loops.TurnLoop`` makes one for each connection its server accepts (the protocol a
``stream.Stream``), on the CPython versions its turn was checked against, out of debug mode;
every other transport on the loop is asyncio's. The server's TLS is its own
(``tls.TlsSession``), so the loop only ever carries plain TCP for it.

It reads asyncio's loop from the inside, as its own transports do (their underscored
``_add_reader``, ``_remove_reader``, ``_add_writer`` and ``_remove_writer``, and a server's
``_attach``/``_detach``). A compiled class cannot be referred to weakly, so it is not entered
in the loop's weak map of transports by file descriptor, which only guards a transport's
socket against ``add_reader`` and the ``sock_*`` calls (nothing on the server's loop makes
them). tests/server/test_transport.py runs it beside asyncio's
transport through the same events and compares what the protocol sees.
"""

# pyright: reportPrivateUsage=false

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any, Final, Protocol, cast

from dflockd_server.transport_handle import ServerHandle

__all__ = ["MAX_READ", "SocketTransport"]

log = logging.getLogger("asyncio")
"""asyncio's logger: what this transport logs is what asyncio's would."""

MAX_READ: Final = 256 * 1024
"""The most bytes one read takes (asyncio's ``max_size``)."""
_HIGH_WATER: Final = 64 * 1024
"""asyncio's default write buffer limits: pause the protocol above 64 KiB, resume at a
quarter of the high-water mark."""
_LOST_WRITES_LOGGED_AFTER: Final = 5
"""Writes after the connection was lost that pass silently (asyncio's
``LOG_THRESHOLD_FOR_CONNLOST_WRITES``)."""
_ATTACH_WITH_TRANSPORT: Final = sys.version_info >= (3, 13)
"""CPython 3.13's ``Server._attach``/``_detach`` take the transport (held weakly: this one
hands over a ``transport_handle.ServerHandle``); 3.11's and 3.12's do not."""


class _Loop(Protocol):
    """What the transport uses of asyncio's selector loop."""

    def _add_reader(self, fd: int, callback: Callable[[], None], /) -> object: ...

    def _remove_reader(self, fd: int, /) -> bool: ...

    def _add_writer(self, fd: int, callback: Callable[[], None], /) -> object: ...

    def _remove_writer(self, fd: int, /) -> bool: ...

    def call_soon(self, callback: Callable[..., object], *args: Any) -> asyncio.Handle: ...

    def call_exception_handler(self, context: dict[str, Any]) -> None: ...

    def get_debug(self) -> bool: ...


class SocketTransport(asyncio.Transport):
    """One accepted plain TCP connection's transport (see the module's doc)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.Protocol,
        *,
        waiter: asyncio.Future[None] | None = None,
        extra: dict[str, Any] | None = None,
        server: Any = None,
    ) -> None:
        info: dict[str, Any] = dict(extra) if extra else {}
        info["socket"] = sock
        try:
            info["sockname"] = sock.getsockname()
        except OSError:
            info["sockname"] = None
        if "peername" not in info:
            try:
                info["peername"] = sock.getpeername()
            except OSError:
                info["peername"] = None
        super().__init__(info)
        selector_loop = cast("_Loop", loop)  # asyncio's selector loop (its private side)
        self._loop: _Loop | None = selector_loop
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._protocol: asyncio.Protocol | None = protocol
        self._server: Any = server
        self._handle: ServerHandle | None = None
        self._buffer = bytearray()
        self._conn_lost = 0
        """Set when ``connection_lost`` is scheduled; then counts the writes that came after."""
        self._closing = False
        self._paused = False
        self._eof = False
        self._high_water = _HIGH_WATER
        self._low_water = _HIGH_WATER // 4
        self._protocol_paused = False
        if server is not None:
            if _ATTACH_WITH_TRANSPORT:
                self._handle = ServerHandle(self)
                server._attach(self._handle)
            else:
                server._attach()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.call_soon(protocol.connection_made, self)
        loop.call_soon(self._start_reading)  # only once connection_made has run
        if waiter is not None:
            loop.call_soon(_wake, waiter)

    def __repr__(self) -> str:
        state = "closed" if self._sock is None else "closing" if self._closing else "open"
        return f"<SocketTransport fd={self._fd} {state} bufsize={len(self._buffer)}>"

    # ------------------------------------------------------------------ the protocol
    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        if not isinstance(protocol, asyncio.Protocol) or isinstance(
            protocol, asyncio.BufferedProtocol
        ):
            raise TypeError("SocketTransport serves a plain asyncio.Protocol only")
        self._protocol = protocol

    # ------------------------------------------------------------------ reading
    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return not self._closing and not self._paused

    def pause_reading(self) -> None:
        if self._closing or self._paused:
            return
        self._paused = True
        loop = self._loop
        assert loop is not None
        loop._remove_reader(self._fd)

    def resume_reading(self) -> None:
        if self._closing or not self._paused:
            return
        self._paused = False
        self._start_reading()

    def _start_reading(self) -> None:
        loop = self._loop
        if loop is not None and not self._closing and not self._paused:
            loop._add_reader(self._fd, self._read_ready)

    def _read_ready(self) -> None:
        if self._conn_lost:
            return
        sock = self._sock
        protocol = self._protocol
        assert sock is not None and protocol is not None
        try:
            data = sock.recv(MAX_READ)
        except (BlockingIOError, InterruptedError):
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, "Fatal read error on socket transport")
            return
        if not data:
            self._read_eof(protocol)
            return
        try:
            protocol.data_received(data)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, "Fatal error: protocol.data_received() call failed.")

    def _read_eof(self, protocol: asyncio.Protocol) -> None:
        try:
            keep_open = protocol.eof_received()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, "Fatal error: protocol.eof_received() call failed.")
            return
        if keep_open:
            # The protocol may still write; nothing more can be read.
            loop = self._loop
            assert loop is not None
            loop._remove_reader(self._fd)
        else:
            self.close()

    # ------------------------------------------------------------------ writing
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        if self._conn_lost:
            if self._conn_lost >= _LOST_WRITES_LOGGED_AFTER:
                log.warning("socket.send() raised exception.")
            self._conn_lost += 1
            return
        if not self._buffer:
            sock = self._sock
            assert sock is not None
            try:  # nothing waits before it: send at once
                n = sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._fatal_error(exc, "Fatal write error on socket transport")
                return
            if n == len(data):
                return
            data = memoryview(data)[n:]
            loop = self._loop
            assert loop is not None
            loop._add_writer(self._fd, self._write_ready)
        self._buffer.extend(data)
        self._maybe_pause_protocol()

    def _write_ready(self) -> None:
        if self._conn_lost:
            return
        sock, loop = self._sock, self._loop
        assert sock is not None and loop is not None
        try:
            n = sock.send(self._buffer)
        except (BlockingIOError, InterruptedError):
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            loop._remove_writer(self._fd)
            self._buffer.clear()
            self._fatal_error(exc, "Fatal write error on socket transport")
            return
        if n:
            del self._buffer[:n]
        self._maybe_resume_protocol()  # may write more
        if not self._buffer:
            loop._remove_writer(self._fd)
            if self._closing:
                self._call_connection_lost(None)
            elif self._eof:
                sock.shutdown(socket.SHUT_WR)

    def write_eof(self) -> None:
        if self._closing or self._eof:
            return
        self._eof = True
        if not self._buffer and self._sock is not None:
            self._sock.shutdown(socket.SHUT_WR)

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return len(self._buffer)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low_water, self._high_water)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = _HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high_water = high
        self._low_water = low
        self._maybe_pause_protocol()

    def _maybe_pause_protocol(self) -> None:
        if len(self._buffer) <= self._high_water or self._protocol_paused:
            return
        self._protocol_paused = True
        protocol = self._protocol
        assert protocol is not None
        try:
            protocol.pause_writing()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._report(exc, "protocol.pause_writing() failed")

    def _maybe_resume_protocol(self) -> None:
        if not self._protocol_paused or len(self._buffer) > self._low_water:
            return
        self._protocol_paused = False
        protocol = self._protocol
        assert protocol is not None
        try:
            protocol.resume_writing()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._report(exc, "protocol.resume_writing() failed")

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        loop = self._loop
        assert loop is not None
        loop._remove_reader(self._fd)
        if not self._buffer:
            self._conn_lost += 1
            loop._remove_writer(self._fd)
            loop.call_soon(self._call_connection_lost, None)

    def abort(self) -> None:
        self._force_close(None)

    def _fatal_error(self, exc: BaseException, message: str) -> None:
        if isinstance(exc, OSError):
            loop = self._loop
            if loop is not None and loop.get_debug():
                log.debug("%r: %s", self, message, exc_info=True)
        else:
            self._report(exc, message)
        self._force_close(exc)

    def _report(self, exc: BaseException, message: str) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_exception_handler(
                {
                    "message": message,
                    "exception": exc,
                    "transport": self,
                    "protocol": self._protocol,
                }
            )

    def _force_close(self, exc: BaseException | None) -> None:
        if self._conn_lost:
            return
        loop = self._loop
        assert loop is not None
        if self._buffer:
            self._buffer.clear()
            loop._remove_writer(self._fd)
        if not self._closing:
            self._closing = True
            loop._remove_reader(self._fd)
        self._conn_lost += 1
        loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        protocol = self._protocol
        try:
            if protocol is not None:
                # asyncio passes any BaseException on; a protocol's connection_lost takes an
                # Exception. One that is not (a cancellation in data_received, say) has gone
                # to the loop's exception handler already, and the loss reads as a close.
                protocol.connection_lost(exc if isinstance(exc, Exception) else None)
        finally:
            if self._sock is not None:
                self._sock.close()
            self._sock = None
            self._protocol = None
            self._loop = None
            server, self._server = self._server, None
            handle, self._handle = self._handle, None
            if server is not None:
                if handle is not None:
                    server._detach(handle)
                else:
                    server._detach()


def _wake(waiter: asyncio.Future[None]) -> None:
    """Tell whoever accepted the connection that ``connection_made`` has run."""
    if not waiter.cancelled():
        waiter.set_result(None)
