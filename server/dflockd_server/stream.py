"""A connection's byte side: ``Stream`` reads and writes bytes (through the TLS session on a
TLS server), pauses reading while the replies go unread, while a blocking request holds up a
full buffer, or for a fragment delay (a sender whose reads keep ending mid-request), and keeps
the read, write and handshake timers; what the bytes mean is ``connection.Connection``'s
business. While the lease journal has records not yet written, a stream holds its replies back
for ``GroupWrite``: one write of the journal per turn of the loop, for every connection, before
any of those replies leaves."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any, Protocol

from dflockd_server import constants as c, protocol as p
from dflockd_server.config import Config
from dflockd_server.journal import Journal
from dflockd_server.tls import TlsSession

__all__ = ["GroupWrite", "Stream", "StreamHost", "refuse_replies"]

log = logging.getLogger("dflockd_server")


class StreamHost(Protocol):
    """What a stream uses of its server (``net.Server``)."""

    config: Config
    longest_fragment_delay: float
    journal: Journal | None
    clock: Callable[[], float]
    ssl_context: ssl.SSLContext | None

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def handshake_started(self, stream: Stream) -> None: ...

    def handshake_ended(self, stream: Stream) -> None: ...

    def fragment_delay(self, earlier: int) -> float: ...

    @property
    def group_write(self) -> GroupWrite: ...


class GroupWrite:
    """The lease journal's group write, once per turn of the loop in which connections held
    replies back for it: one write (and with ``--journal-fsync always`` one fsync) for every
    connection of the turn, then each sends what it held back. If the journal cannot be
    written, no connection is dropped and no lock freed: the batch's grants are undone (nobody
    was told of them) and their replies become ``error_read_only``; the server grants nothing
    until the journal can be written again.

    A lone connection writes the journal itself (``direct``), as holding replies back costs it
    more than the write: after ``JOURNAL_LONE_TURNS`` group writes in a row of one connection's
    replies (unless the fsync is ``always``), each connection writes the buffered records just
    before its replies, for ``JOURNAL_DIRECT_WRITES`` writes; then the group write looks again."""

    def __init__(self, call_soon: Callable[[Callable[[], None]], object]) -> None:
        self._call_soon = call_soon
        self.journal: Journal | None = None
        """The server's journal while it runs (None once closed: replies go out unwritten)."""
        self.streams: list[Stream] = []  # the connections whose replies wait for the next write
        self._write_soon: Callable[[], None] = self.write  # bound once
        self.direct = False  # connections write the journal before their replies (write_for)
        self.lone = 0  # group writes in a row that held back one connection's replies
        self.direct_left = 0
        self.undo: Callable[[str, str], object] | None = None
        """Releases a grant (key, token) nobody was told of (the table's ``release``)."""

    def hold_back(self, stream: Stream) -> None:
        """``stream`` holds replies back until the journal is written (once per turn)."""
        if not self.streams:
            self._call_soon(self._write_soon)
        self.streams.append(stream)

    def write_for(self, stream: Stream, journal: Journal, data: bytes) -> bytes:
        """``stream``, alone in its turns, writes the journal before its replies ``data``;
        returns them as they may leave (a grant the journal could not hold refused)."""
        journal.flush()
        if journal.refused:
            data = refuse_replies(data, self._refuse(journal, self.streams))
        self.direct_left -= 1
        if self.direct_left <= 0:
            self.direct = False
            self.lone = 0
        return data

    def _refuse(self, journal: Journal, streams: list[Stream]) -> list[bytes]:
        """The grants a write could not hold: released (nobody was told of them), and the
        replies ``streams`` held back for them refused; their tokens."""
        refused = journal.take_refused()
        if (undo := self.undo) is not None:
            for key, token in refused:
                undo(key, token)
        journal.flush()  # their drops: not recorded while the journal cannot be written
        tokens = [token.encode() for _, token in refused]
        for stream in streams:
            stream.refuse_held(tokens)
        return tokens

    def settle(self, journal: Journal) -> None:
        """Write the journal outside a turn's group write (the sweep), as ``write`` does."""
        journal.flush()
        if journal.refused:
            self._refuse(journal, self.streams)

    def write(self) -> None:
        """Write the journal, then send what each connection held back."""
        held, self.streams = self.streams, []
        journal = self.journal
        if journal is not None:
            if len(held) == 1 and journal.fsync != "always":
                self.lone += 1
                if self.lone >= c.JOURNAL_LONE_TURNS:
                    self.direct = True
                    self.direct_left = c.JOURNAL_DIRECT_WRITES
            else:
                self.lone = 0
            journal.flush()
            if journal.refused:
                self._refuse(journal, held)
        for stream in held:
            stream.send_held()


def refuse_replies(data: bytes, tokens: list[bytes]) -> bytes:
    """``data`` (reply lines) with each reply that carries one of ``tokens`` (a grant the
    journal could not hold) replaced by ``error_read_only``."""
    if not any(token in data for token in tokens):
        return data
    refused = p.REPLY_ERROR_READ_ONLY.rstrip(b"\n")
    return b"\n".join(
        refused if any(token in line for token in tokens) else line for line in data.split(b"\n")
    )


class Stream:
    """One connection's bytes (see the module's doc)."""

    __slots__ = (
        "_group_write",
        "_host",
        "busy",
        "clock",
        "close_when_sent",
        "closing",
        "delay_timer",
        "fragment_delays",
        "framer",
        "handshake_timer",
        "held",
        "idle_ok",
        "ip",
        "journal",
        "last_rx",
        "loop",
        "more_scheduled",
        "peer",
        "read_delayed",
        "read_timer",
        "reading_paused",
        "tls",
        "transport",
        "unsent",
        "write_paused",
        "write_timer",
    )

    def __init__(self, server: StreamHost) -> None:
        self.loop = server.loop
        self.clock = server.clock
        self.framer = p.RequestFramer()
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.ip = ""
        self.busy = False  # a request in flight (the connection sets it): no read timeout
        self.idle_ok: Callable[[], bool] | None = None
        """True while its silence is no sign of a dead peer (a live client session's)."""
        self.more_scheduled = False  # buffered requests left for a later pass (fairness)
        self.closing = False
        self.tls: TlsSession | None = None  # on a TLS server: the session over this connection
        self.reading_paused = False
        self.write_paused = False
        self.read_delayed = False  # a dripping sender: read again after a fragment delay
        self.fragment_delays = 0  # fragment delays since a request was last completed
        self.last_rx = 0.0
        self.read_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.delay_timer: asyncio.TimerHandle | None = None
        self.handshake_timer: asyncio.TimerHandle | None = None
        self._host = server
        self._group_write = server.group_write
        self.journal = server.journal
        """Written before any reply leaves: a client is never told of what it does not hold."""
        self.held: list[bytes] | None = None  # replies held back for the next group write
        self.close_when_sent = False
        self.unsent: list[bytes] | None = None
        """Replies held back, dropped unsent (the connection frees a waiter's grant in them)."""

    def open(self, transport: asyncio.Transport) -> None:
        """Start the stream of an admitted connection: buffer limits, timers, TLS."""
        host = self._host
        config = host.config
        transport.set_write_buffer_limits(c.WRITE_BUFFER_HIGH_WATER, c.WRITE_BUFFER_LOW_WATER)
        self.last_rx = self.clock()
        if config.read_timeout_s > 0:
            self.read_timer = self.loop.call_later(config.read_timeout_s, self._read_timer_fired)
        if host.ssl_context is not None:
            self.tls = TlsSession(host.ssl_context)
            self.handshake_timer = self.loop.call_later(
                config.tls_handshake_timeout_s, self._handshake_timed_out
            )
            host.handshake_started(self)

    def lost(self) -> None:
        """The transport is gone: stop the timers, end the handshake's slot."""
        self.closing = True
        self.framer.clear()
        for timer in (self.read_timer, self.write_timer, self.delay_timer, self.handshake_timer):
            if timer is not None:
                timer.cancel()
        if self.tls is not None and not self.tls.handshake_done:
            self._host.handshake_ended(self)

    def set_peer(self, peer: Any) -> None:
        if isinstance(peer, tuple) and peer:
            self.ip = str(peer[0])  # pyright: ignore[reportUnknownArgumentType]
            self.peer = f"{self.ip}:{peer[1]}"

    def decrypt(self, tls: TlsSession, data: bytes) -> bytes:
        """The request bytes that ``data`` completes (``b""``: none yet, the connection
        closes, or ``tls.peer_closed``); sends what the TLS session has to send."""
        transport = self.transport
        assert transport is not None
        was_done = tls.handshake_done
        try:
            plain = tls.receive(data)
        except ssl.SSLError as exc:
            log.debug("TLS with %s failed: %s", self.peer, exc)
            if out := tls.outgoing():  # the alert, if OpenSSL made one
                transport.write(out)
            self.closing = True
            transport.close()
            return b""
        if out := tls.outgoing():
            transport.write(out)
        if tls.handshake_done and not was_done:
            if self.handshake_timer is not None:
                self.handshake_timer.cancel()
                self.handshake_timer = None
            self._host.handshake_ended(self)
        return plain

    def _handshake_timed_out(self) -> None:
        self.handshake_timer = None
        if not self.closing:
            log.debug("connection %s: TLS handshake not done in time, dropping", self.peer)
            self.abort()

    def send(self, transport: asyncio.Transport, data: bytes) -> None:
        """Write reply bytes after the journal's records not written yet: held back for the
        turn's group write, or, in ``GroupWrite.direct``, after ``GroupWrite.write_for``."""
        journal = self.journal
        if journal is not None and (journal.buf or self.held is not None):
            group_write = self._group_write
            if self.held is not None or not group_write.direct:
                held = self.held
                if held is None:
                    held = self.held = []
                    group_write.hold_back(self)
                held.append(data)
                return
            data = group_write.write_for(self, journal, data)
        self._send_now(transport, data)

    def refuse_held(self, tokens: list[bytes]) -> None:
        """Refuse the held-back replies that tell of a grant the journal could not hold."""
        if (held := self.held) is not None:
            self.held = [refuse_replies(data, tokens) for data in held]

    def send_held(self) -> None:
        """The journal holds the records: send the replies held back (then close, if asked)."""
        held, self.held = self.held, None
        transport = self.transport
        if held is None:
            return
        if transport is None or transport.is_closing():
            self.unsent = held
            return
        self._send_now(transport, held[0] if len(held) == 1 else b"".join(held))
        if self.close_when_sent:
            self.close_when_sent = False
            self._close_transport(transport)

    def _send_now(self, transport: asyncio.Transport, data: bytes) -> None:
        tls = self.tls
        if tls is None:
            transport.write(data)
            return
        try:
            transport.write(tls.send(data))
        except ssl.SSLError as exc:
            log.debug("connection %s: TLS write failed: %s", self.peer, exc)
            self.abort()

    def close(self) -> None:
        """Close after the buffered replies are sent (a TLS connection ends its session)."""
        transport = self.transport
        if transport is None or self.closing:
            return
        self.closing = True
        if self.held is not None:
            self.close_when_sent = True  # after the replies held back for the journal
            return
        self._close_transport(transport)

    def _close_transport(self, transport: asyncio.Transport) -> None:
        if self.tls is not None and (alert := self.tls.close_notify()):
            transport.write(alert)
        transport.close()

    def pause_writing(self) -> None:
        self.write_paused = True
        self.update_reading()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(
                self._host.config.write_timeout_s, self._write_timer_fired
            )

    def delay_reading(self) -> None:
        """Stop reading, for a fragment delay (``Server.fragment_delay``), a sender whose reads
        keep ending mid-request: a slowloris's bytes come in one read, not one wake-up each."""
        if self.delay_timer is not None:
            return  # already waiting one out (a read the loop had in hand when it paused)
        self.read_delayed = True
        self.update_reading()
        delay = self._host.fragment_delay(self.fragment_delays)
        self.fragment_delays += 1
        self.delay_timer = self.loop.call_later(delay, self._delay_over)

    def _delay_over(self) -> None:
        self.delay_timer = None
        self.read_delayed = False
        self.update_reading()

    def _read_timer_fired(self) -> None:
        self.read_timer = None
        if self.closing:
            return
        timeout = self._host.config.read_timeout_s
        idle = self.clock() - self.last_rx
        if self.read_delayed:  # bytes may be waiting unread: judge once the delay is over
            self.read_timer = self.loop.call_later(
                max(timeout - idle, self._host.longest_fragment_delay), self._read_timer_fired
            )
            return
        idle_ok = self.idle_ok
        if self.busy or idle < timeout or (idle_ok is not None and idle_ok()):
            delay = timeout if self.busy or idle >= timeout else timeout - idle
            self.read_timer = self.loop.call_later(delay, self._read_timer_fired)
            return
        log.debug("connection %s: read timeout after %.1f s idle", self.peer, idle)
        self.abort()

    def _write_timer_fired(self) -> None:
        self.write_timer = None
        if not self.closing:
            log.debug("connection %s: replies unread for the write timeout, dropping", self.peer)
            self.abort()

    def abort(self) -> None:
        """Close at once, dropping what is unsent."""
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    def close_with(self, reply: bytes) -> None:
        """Send a last reply and close (buffered replies are flushed first)."""
        transport = self.transport
        if transport is not None and not transport.is_closing() and not self.closing:
            self.send(transport, reply)
            self.close()
        self.closing = True

    def update_reading(self) -> None:
        transport = self.transport
        if transport is None or self.closing:
            return
        want_pause = (
            self.write_paused
            or self.read_delayed
            or (
                (self.busy or self.more_scheduled)
                and self.framer.buffered() > c.MAX_PIPELINE_BUFFER
            )
        )
        if want_pause != self.reading_paused:
            self.reading_paused = want_pause
            if want_pause:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.closing:
            self.send(transport, data)
