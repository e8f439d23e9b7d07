"""The asyncio shell: ``Server`` (listener, maintenance timers, shutdown) and ``Connection``.

Connections only move bytes between the socket, the sans-I/O parser (``protocol``) and the
lock table (``table``). Each connection answers its requests in order; a blocking acquire holds
up the requests behind it on that connection only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import random
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any, cast

from dflockd_server import constants as c
from dflockd_server import protocol as p
from dflockd_server.config import Config
from dflockd_server.fence import FenceCounter, FenceStateError
from dflockd_server.grace import LeaseRecord, decide_grace, grace_path, read_longest_lease
from dflockd_server.metrics import MetricsExporter, RequestTimes
from dflockd_server.snapshots import RationedSnapshots
from dflockd_server.table import (
    AlreadyEnqueued,
    Client,
    Holder,
    LimitMismatch,
    LockTable,
    MaxLocks,
    MaxWaiters,
    Waiter,
)
from dflockd_server.tls import TlsSession, build_ssl_context

log = logging.getLogger("dflockd_server")

_LOCKS = (c.CMD_LOCK, c.CMD_SEM_LOCK)
_ENQUEUES = (c.CMD_ENQUEUE, c.CMD_SEM_ENQUEUE)
_WAITS = (c.CMD_WAIT, c.CMD_SEM_WAIT)
_RENEWS = (c.CMD_RENEW, c.CMD_SEM_RENEW)
_RELEASES = (c.CMD_RELEASE, c.CMD_SEM_RELEASE)
_AUTH = c.CMD_AUTH.encode()
_LOCK = c.CMD_LOCK.encode()
_RELEASE = c.CMD_RELEASE.encode()
_RENEW = c.CMD_RENEW.encode()
_JITTER_MIN, _JITTER_MAX = 0.5, 1.5  # of a fragment delay
_WHILE_DRAINING = frozenset(
    command.encode()
    for command in (
        c.CMD_RELEASE,
        c.CMD_SEM_RELEASE,
        c.CMD_RENEW,
        c.CMD_SEM_RENEW,
        c.CMD_PING,
        c.CMD_HELLO,
        c.CMD_STATS,
        c.CMD_AUTH,
    )
)
"""What a draining server still answers: its holders can renew and release until they are
done (or the shutdown timeout), and see that it is up; acquires and waits get
``error_draining``."""
_REFUSALS = (MaxLocks, MaxWaiters, LimitMismatch, AlreadyEnqueued, FenceStateError)


class Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = server.loop
        self.table = server.table
        self.framer = p.RequestFramer()
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.peer = "?"
        self.ip = ""
        self.authed = server.secret is None
        self.default_lease = server.config.default_lease_ttl_s
        self.max_lease = server.config.max_lease_ttl_s
        self.busy = False  # a request is in flight
        self.more_scheduled = False  # buffered requests left for a later pass (fairness)
        self.budget = 0  # requests the pass under way may still answer
        self.auth_failed_at: float | None = None  # loop time of a wrong secret
        self.closing = False
        self.eof = False  # the client sent EOF: close once what it sent is answered
        self.tls: TlsSession | None = None  # on a TLS server: the session over this connection
        self.reading_paused = False
        self.write_paused = False
        self.read_delayed = False  # a dripping sender: read again after a fragment delay
        self.fragment_delays = 0  # fragment delays since a request was last completed
        self.last_rx = 0.0
        self.waiter: Waiter | None = None
        self.wait_started = 0.0  # perf_counter() when the in-flight wait began (metrics on)
        self.wait_command = b""
        self.wait_timer: asyncio.TimerHandle | None = None
        self.read_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.delay_timer: asyncio.TimerHandle | None = None
        self.handshake_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: no isinstance check here.
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        self.server.open_transports += 1
        self.set_peer(transport.get_extra_info("peername"))
        refusal = self.server.admit(self)
        if refusal is not None:
            log.debug("refused connection from %s: %s", self.peer, refusal)
            self.closing = True
            transport.close()  # accepted, then closed at once (a FIN, nothing written)
            return
        self.client = self.table.open_client()
        transport.set_write_buffer_limits(c.WRITE_BUFFER_HIGH_WATER, c.WRITE_BUFFER_LOW_WATER)
        self.last_rx = self.loop.time()
        if self.server.config.read_timeout_s > 0:
            self.read_timer = self.loop.call_later(
                self.server.config.read_timeout_s, self._read_timer_fired
            )
        if self.server.ssl_context is not None:
            self.tls = TlsSession(self.server.ssl_context)
            self.handshake_timer = self.loop.call_later(
                self.server.config.tls_handshake_timeout_s, self._handshake_timed_out
            )
            self.server.handshake_started(self)
        log.debug("connection %d from %s", self.client.id, self.peer)

    def set_peer(self, peer: Any) -> None:
        """Record the peer's address (``peername``, or what ``accept`` returned)."""
        if isinstance(peer, tuple) and peer:
            self.ip = str(peer[0])  # pyright: ignore[reportUnknownArgumentType]
            self.peer = f"{self.ip}:{peer[1]}"

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.open_transports -= 1
        self.closing = True
        self.framer.clear()
        for timer in (
            self.wait_timer,
            self.read_timer,
            self.write_timer,
            self.delay_timer,
            self.handshake_timer,
        ):
            if timer is not None:
                timer.cancel()
        if self.tls is not None and not self.tls.handshake_done:
            self.server.handshake_ended(self)
        if self.waiter is not None:
            self.waiter.wake = None
            self.waiter = None
        client = self.client
        if client is None:
            return  # refused at admission
        self.client = None
        self._set_busy(False)
        self.table.disconnect(client)
        if self.auth_failed_at is not None:
            # A wrong secret keeps its connection slot for the whole failure delay, also when
            # the client hangs up without waiting for the answer: otherwise hanging up early
            # would make guessing free, and the connection caps could not slow it down.
            self.loop.call_at(
                self.auth_failed_at + c.AUTH_FAILURE_DELAY_S, self.server.forget, self
            )
        else:
            self.server.forget(self)
        log.debug("connection %d from %s closed%s", client.id, self.peer, f": {exc}" if exc else "")

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.last_rx = self.loop.time()
        if self.tls is not None:
            data = self._decrypt(self.tls, data)
            if not data:
                return
        framer = self.framer
        before = framer.buffered()  # > 0: the end of an unfinished request was awaited
        framer.feed(data)
        if not self.busy and not self.more_scheduled:
            self._process()
            if before and framer.buffered() == before + len(data):
                if not self.closing:
                    self._delay_reading()  # a second read in a row that completed nothing
            elif self.fragment_delays:
                self.fragment_delays = 0
        elif framer.buffered() > c.MAX_PIPELINE_BUFFER:
            self._update_reading()  # a blocking request or a later pass holds the rest up
        if self.tls is not None and self.tls.peer_closed:
            self._peer_closed()

    def eof_received(self) -> bool | None:
        # No more requests can come. Answer those already received (a pass answers at most
        # MAX_REQUESTS_PER_PASS), acquires among them tried once, then close: see _end_if_eof.
        if self.closing or self.busy:
            return None  # a wait in flight: the client is gone (a killed process's FIN)
        self.eof = True
        if self.more_scheduled or self.framer.buffered():
            # Keep the transport open for the replies (plain TCP only); a pass answers what
            # is complete, then closes (an unfinished request is never completed now).
            self._process_later()
            return True
        return None

    def _end_if_eof(self) -> None:
        """After the client's EOF: close once every request it sent has been answered."""
        if self.eof and not (self.busy or self.more_scheduled or self.write_paused or self.closing):
            self._close()

    # ------------------------------------------------------------------ TLS
    def _decrypt(self, tls: TlsSession, data: bytes) -> bytes:
        """The request bytes that ``data`` completes (``b""``: none yet, or the connection
        closes); sends what the TLS session has to send, and ends the handshake's timer and
        slot when the handshake is done. The peer's ``close_notify`` counts as its EOF, once
        the requests before it are in."""
        transport = self.transport
        assert transport is not None
        was_done = tls.handshake_done
        try:
            plain = tls.receive(data)
        except ssl.SSLError as exc:
            log.debug("TLS with %s failed: %s", self.peer, exc)
            out = tls.outgoing()  # the alert, if OpenSSL made one
            if out:
                transport.write(out)
            self.closing = True
            transport.close()
            return b""
        out = tls.outgoing()
        if out:
            transport.write(out)
        if tls.handshake_done and not was_done:
            if self.handshake_timer is not None:
                self.handshake_timer.cancel()
                self.handshake_timer = None
            self.server.handshake_ended(self)
        if tls.peer_closed and not plain:
            self._peer_closed()
        return plain

    def _peer_closed(self) -> None:
        """The client ended its TLS session: as an EOF (its requests are answered, then the
        connection closes)."""
        if not self.closing and self.eof_received() is None:
            self._close()

    def _handshake_timed_out(self) -> None:
        self.handshake_timer = None
        if not self.closing:
            log.debug("connection %s: TLS handshake not done in time, dropping", self.peer)
            self.abort()

    def _send(self, transport: asyncio.Transport, data: bytes) -> None:
        """Write reply bytes, through the TLS session on a TLS connection."""
        tls = self.tls
        if tls is None:
            transport.write(data)
            return
        try:
            transport.write(tls.send(data))
        except ssl.SSLError as exc:
            log.debug("connection %s: TLS write failed: %s", self.peer, exc)
            self.abort()

    def _close(self) -> None:
        """Close after the buffered replies are sent (a TLS connection ends its session)."""
        transport = self.transport
        if transport is None or self.closing:
            return
        self.closing = True
        if self.tls is not None:
            alert = self.tls.close_notify()
            if alert:
                transport.write(alert)
        transport.close()

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(
                self.server.config.write_timeout_s, self._write_timer_fired
            )

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        if not self.busy and self.framer.buffered():
            self._process_later()
        elif self.eof:
            self._end_if_eof()
            return
        self._update_reading()

    # ------------------------------------------------------------------ timers
    def _delay_reading(self) -> None:
        """Stop reading, for a fragment delay, a sender whose reads keep ending mid-request.

        Each byte of a slowloris client costs the server a wake-up and a read; read after a
        delay, its bytes come in one read instead. The delays double while the sender keeps
        dripping, and their jitter keeps drippers that started together from being read
        again together, in bursts that whole requests from other clients would wait behind.
        A client that sends whole requests never gets here; a request that straddles three
        reads or more waits ``FRAGMENT_READ_DELAY_S`` (jittered) for its third."""
        if self.delay_timer is not None:
            return  # already waiting one out (a read the loop had in hand when it paused)
        self.read_delayed = True
        self._update_reading()
        delay = self.server.fragment_delay(self.fragment_delays)
        self.fragment_delays += 1
        self.delay_timer = self.loop.call_later(delay, self._delay_over)

    def _delay_over(self) -> None:
        self.delay_timer = None
        self.read_delayed = False
        self._update_reading()

    def _read_timer_fired(self) -> None:
        self.read_timer = None
        if self.closing:
            return
        timeout = self.server.config.read_timeout_s
        idle = self.loop.time() - self.last_rx
        if self.read_delayed:
            # Bytes may be waiting unread: judge idleness once the delay is over.
            self.read_timer = self.loop.call_later(
                max(timeout - idle, self.server.longest_fragment_delay), self._read_timer_fired
            )
            return
        if self.busy or idle < timeout:
            delay = timeout if self.busy else timeout - idle
            self.read_timer = self.loop.call_later(delay, self._read_timer_fired)
            return
        log.debug("connection %s: read timeout after %.1f s idle", self.peer, idle)
        self.abort()

    def _write_timer_fired(self) -> None:
        self.write_timer = None
        if not self.closing:
            log.debug("connection %s: replies unread for the write timeout, dropping", self.peer)
            self.abort()

    # ------------------------------------------------------------------ helpers
    def abort(self) -> None:
        """Close at once, dropping what is unsent."""
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    def _close_with(self, reply: bytes) -> None:
        """Send a last reply and close (buffered replies are flushed first)."""
        transport = self.transport
        if transport is not None and not transport.is_closing() and not self.closing:
            self._send(transport, reply)
            self._close()
        self.closing = True

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.server.busy_changed(busy)

    def _update_reading(self) -> None:
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

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.closing:
            self._send(transport, data)

    def _done_waiting(self, reply: bytes) -> None:
        """A blocking request got its answer: send it, then carry on with pipelined ones."""
        self.waiter = None
        if self.wait_timer is not None:
            self.wait_timer.cancel()
            self.wait_timer = None
        self._set_busy(False)
        self.last_rx = self.loop.time()
        times = self.server.request_times
        if times is not None and self.wait_command:
            times.observe(self.wait_command, time.perf_counter() - self.wait_started)
            self.wait_command = b""
        self._write(reply)
        if self.framer.buffered():
            self._process_later()
        elif self.eof:
            self._end_if_eof()
        else:
            self._update_reading()

    # ------------------------------------------------------------------ requests
    def _process_later(self) -> None:
        """Answer the buffered requests on a later pass of the event loop."""
        if not self.more_scheduled:
            self.more_scheduled = True
            self.loop.call_soon(self._process)

    def _process(self) -> None:
        """Answer buffered requests in order until one blocks, the buffer runs dry, the
        client stops reading, or the pass's budget is spent: ``MAX_REQUESTS_PER_PASS``
        requests, or one ``stats`` (the rest wait for a later pass, after the other
        connections had their turn). Replies are batched into one write per pass."""
        self.more_scheduled = False
        out: list[bytes] = []
        pending = 0
        framer = self.framer
        transport = self.transport
        times = self.server.request_times
        self.budget = c.MAX_REQUESTS_PER_PASS
        while not self.busy and not self.closing and not self.write_paused:
            if self.budget <= 0:
                if framer.buffered():
                    self._process_later()
                break
            self.budget -= 1
            try:
                frame = framer.next_frame()
            except p.LineTooLong:
                log.debug("connection %s: request line too long, closing", self.peer)
                framer.clear()
                out.append(p.REPLY_ERROR)
                self._close_with(b"".join(out))
                return
            if frame is None:
                break
            if times is None:
                reply = self._handle(frame)
            else:
                started = time.perf_counter()
                reply = self._handle(frame)
                if reply is not None:
                    times.observe(frame[0], time.perf_counter() - started)
                elif self.waiter is not None:
                    self.wait_started, self.wait_command = started, frame[0]
            if reply is not None:
                out.append(reply)
                pending += len(reply)
                if pending >= c.WRITE_BUFFER_LOW_WATER and transport is not None:
                    self._send(transport, b"".join(out))  # may call pause_writing
                    out.clear()
                    pending = 0
        if out and transport is not None and not transport.is_closing():
            self._send(transport, out[0] if len(out) == 1 else b"".join(out))
        if self.eof:
            self._end_if_eof()
            return
        if self.reading_paused or self.write_paused or self.busy or self.more_scheduled:
            self._update_reading()  # otherwise reading is on and stays on: nothing to do

    def _handle(self, frame: p.Frame) -> bytes | None:
        """Answer one request; ``None`` when the answer comes later (or the connection closes)."""
        cmd, key, arg = frame
        if not self.authed and cmd != _AUTH:
            log.debug("connection %s: request before auth, closing", self.peer)
            self._close_with(p.REPLY_ERROR_AUTH)
            return None
        if self.server.draining and cmd not in _WHILE_DRAINING:
            return p.REPLY_ERROR_DRAINING  # nothing new is granted; releases still work
        # Locks, releases and renewals in their usual shapes skip building a Request.
        if cmd == _LOCK:
            quick = p.quick_lock(key, arg)
            if quick is not None:
                return self._acquire(quick[0], quick[1], quick[2], None)
        elif cmd == _RELEASE:
            quick = p.quick_token(key, arg)
            if quick is not None and quick[2] is None:
                return self._release(quick[0], quick[1])
        elif cmd == _RENEW:
            quick = p.quick_token(key, arg)
            if quick is not None:
                return self._renew(quick[0], quick[1], quick[2])
        try:
            req = p.decode_request(cmd, key, arg)
        except p.Malformed as exc:
            log.debug("connection %s: malformed request: %s", self.peer, exc)
            return p.REPLY_ERROR
        command = req.command
        if req.lease is not None and req.lease > self.max_lease:
            return self._too_long(req.lease)
        if command in _LOCKS:
            return self._acquire(req.key, req.timeout, req.lease, req.limit)
        if command in _RELEASES:
            return self._release(req.key, req.token)
        if command in _RENEWS:
            return self._renew(req.key, req.token, req.lease)
        client = self.client
        assert client is not None
        table = self.table
        try:
            if command in _ENQUEUES:
                lease = req.lease or self.default_lease
                waiter = table.enqueue(client, req.key, lease, req.limit)
                holder = waiter.holder
                if holder is None:
                    return p.REPLY_QUEUED
                return p.reply_grant(c.STATUS_ACQUIRED, holder.token, holder.lease_ttl)
            if command in _WAITS:
                return self._two_phase_wait(client, req.key, req.timeout)
            if command == c.CMD_PING:
                return p.REPLY_OK
            if command == c.CMD_HELLO:
                return self.server.hello_reply
            if command == c.CMD_STATS:
                self.budget = 0  # its cost grows with the table: the last request of the pass
                snapshots = self.server.snapshots
                assert snapshots is not None
                reply = snapshots.request(self)
                if reply is None:
                    self._set_busy(True)  # answered with the next snapshot (stats_ready)
                return reply
            return self._auth(req.secret)
        except _REFUSALS as exc:
            return self._refusal(exc)

    def _acquire(
        self, key: str, timeout: int, lease: int | None, limit: int | None
    ) -> bytes | None:
        client = self.client
        assert client is not None
        if lease is not None and lease > self.max_lease:
            return self._too_long(lease)
        try:
            got = self.table.acquire(
                # After the client's EOF nobody waits for an answer to come later: try once.
                client,
                key,
                lease or self.default_lease,
                limit,
                queue=timeout > 0 and not self.eof,
            )
        except _REFUSALS as exc:
            return self._refusal(exc)
        if got is None:
            return p.REPLY_TIMEOUT
        if isinstance(got, Holder):
            return p.reply_grant(c.STATUS_OK, got.token, got.lease_ttl)
        self._wait(got, timeout)
        return None

    def _release(self, key: str, token: str) -> bytes:
        try:
            released = self.table.release(key, token)
        except _REFUSALS as exc:
            return self._refusal(exc)
        return p.REPLY_OK if released else p.REPLY_ERROR

    def _renew(self, key: str, token: str, lease: int | None) -> bytes:
        if lease is not None and lease > self.max_lease:
            return self._too_long(lease)
        try:
            remaining = self.table.renew(key, token, lease or self.default_lease)
        except _REFUSALS as exc:
            return self._refusal(exc)
        return p.REPLY_ERROR if remaining is None else p.reply_renewed(remaining)

    def _too_long(self, lease: int) -> bytes:
        """A lease above ``max_lease_ttl_s`` is a bad number: ``error``, as for lease 0."""
        log.debug(
            "connection %s: lease %d s above max_lease_ttl_s (%d s): error",
            self.peer,
            lease,
            self.max_lease,
        )
        return p.REPLY_ERROR

    def _refusal(self, exc: Exception) -> bytes:
        """The reply to a request the table refused (or could not serve)."""
        if isinstance(exc, MaxLocks):
            return p.REPLY_ERROR_MAX_LOCKS
        if isinstance(exc, MaxWaiters):
            return p.REPLY_ERROR_MAX_WAITERS
        if isinstance(exc, LimitMismatch):
            return p.REPLY_ERROR_LIMIT_MISMATCH
        if isinstance(exc, AlreadyEnqueued):
            return p.REPLY_ERROR_ALREADY_ENQUEUED
        # FenceStateError: the server's fault, not the client's: say so loudly.
        log.error("cannot issue a token: %s", exc)
        return p.REPLY_ERROR

    def _wait(self, waiter: Waiter, timeout: int) -> None:
        self.waiter = waiter
        waiter.wake = self._granted
        self._set_busy(True)
        self.wait_timer = self.loop.call_later(timeout, self._wait_timed_out)

    def _granted(self, waiter: Waiter) -> None:
        holder = waiter.holder
        assert holder is not None
        self.table.forget_enqueued(waiter)
        waiter.wake = None
        self._done_waiting(p.reply_grant(c.STATUS_OK, holder.token, holder.lease_ttl))

    def _wait_timed_out(self) -> None:
        self.wait_timer = None
        waiter = self.waiter
        if waiter is None:
            return
        waiter.wake = None
        self.table.cancel_wait(waiter)
        self._done_waiting(p.REPLY_TIMEOUT)

    def _two_phase_wait(self, client: Client, key: str, timeout: int) -> bytes | None:
        waiter = self.table.find_enqueued(client, key)
        if waiter is None:
            return p.REPLY_ERROR_NOT_ENQUEUED
        holder = waiter.holder
        if holder is not None:
            self.table.forget_enqueued(waiter)
            if not holder.live:
                return p.REPLY_ERROR_LEASE_EXPIRED
            return p.reply_grant(c.STATUS_OK, holder.token, holder.lease_ttl)
        if timeout == 0 or self.eof:
            self.table.cancel_wait(waiter)
            return p.REPLY_TIMEOUT
        self._wait(waiter, timeout)
        return None

    def _auth(self, secret: bytes) -> bytes | None:
        expected = self.server.secret
        if expected is None:
            return p.REPLY_ERROR
        if hmac.compare_digest(secret, expected):
            self.authed = True
            return p.REPLY_OK
        log.debug("connection %s: wrong auth secret", self.peer)
        self._set_busy(True)
        self.authed = False
        self.auth_failed_at = self.loop.time()
        self.loop.call_later(c.AUTH_FAILURE_DELAY_S, self._close_with, p.REPLY_ERROR_AUTH)
        return None

    def stats_ready(self, reply: bytes) -> None:
        """The ``stats`` this connection waits for is answered (a snapshot taken after it
        asked)."""
        if not self.closing:
            self._done_waiting(reply)

    # ------------------------------------------------------------------ shutdown
    def refuse_wait(self) -> None:
        """The server drains: answer a blocked acquire with ``error_draining`` (the connection
        stays open: it may hold locks to release)."""
        waiter = self.waiter
        if waiter is not None:
            waiter.wake = None
            self.table.cancel_wait(waiter)
            self._done_waiting(p.REPLY_ERROR_DRAINING)

    def drain_now(self) -> None:
        """Shutdown deadline: answer an in-flight wait with ``error_draining`` and close."""
        waiter = self.waiter
        if waiter is not None:
            waiter.wake = None
            self.table.cancel_wait(waiter)
            self.waiter = None
            if self.wait_timer is not None:
                self.wait_timer.cancel()
                self.wait_timer = None
            self._close_with(p.REPLY_ERROR_DRAINING)
        else:
            self._close()


class Server:
    """A dflockd-compatible lock server: ``await start()``, ``port``, ``await stop()``."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Config()
        self.secret: bytes | None = None
        self.draining = False
        self.connections: set[Connection] = set()
        self.per_ip: dict[str, int] = {}
        self._busy = 0
        self._idle: asyncio.Event | None = None
        self._stopped: asyncio.Event | None = None
        self._stopping = False
        self._listener: asyncio.Server | None = None
        self.ssl_context: ssl.SSLContext | None = None
        """On a TLS server: the context each connection's ``TlsSession`` is made from."""
        self.handshaking: dict[Connection, None] = {}
        """Connections in their TLS handshake, oldest first (``max_tls_handshakes``)."""
        self.handshakes_evicted = 0
        self.snapshots: RationedSnapshots | None = None
        """Answers ``stats`` (rationed: see ``snapshots``)."""
        self._timers: list[asyncio.TimerHandle] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._table: LockTable | None = None
        self.fence: FenceCounter | None = None
        self.lease_record: LeaseRecord | None = None
        from dflockd_server import __version__  # the package imports this module

        self.hello_reply = p.reply_hello(__version__)
        """The ``hello`` reply: what this server is and supports."""
        self.connections_accepted = 0
        self.connections_refused = 0
        self.open_transports = 0  # made and not yet lost, admitted or refused
        # Per-command request timing and its HTTP exporter, when metrics_port is set.
        self.request_times: RequestTimes | None = None
        self.metrics: MetricsExporter | None = None
        self._jitter = random.Random()
        cap = c.FRAGMENT_READ_DELAY_MAX_S
        if self.config.read_timeout_s > 0:
            cap = min(cap, self.config.read_timeout_s / 4)
        self._fragment_delay_cap = cap
        self.longest_fragment_delay = _JITTER_MAX * cap

    # ------------------------------------------------------------------ properties
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("server not started")
        return self._loop

    @property
    def table(self) -> LockTable:
        if self._table is None:
            raise RuntimeError("server not started")
        return self._table

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        return self.sockname[1]

    @property
    def sockname(self) -> tuple[str, int]:
        sockets: Sequence[Any] = self._listener.sockets if self._listener is not None else ()
        if not sockets:
            raise RuntimeError("server not started")
        name: Any = sockets[0].getsockname()
        return str(name[0]), int(name[1])

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind and start serving; returns once the listening socket is open."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        self._loop = loop
        token = cfg.resolve_auth_token()
        self.secret = token.encode() if token is not None else None
        if cfg.tls_cert and cfg.tls_key:
            self.ssl_context = build_ssl_context(cfg.tls_cert, cfg.tls_key)
        record_path = None
        previous_longest = None
        fence_file_existed = False
        if cfg.fence_state_file is not None:
            record_path = grace_path(cfg.fence_state_file)
            previous_longest = read_longest_lease(record_path)
            fence_file_existed = os.path.exists(cfg.fence_state_file)
        grace = decide_grace(cfg, previous_longest, fence_file_existed)
        self.fence = FenceCounter(cfg.fence_state_file)
        # Recorded before serving: a start killed during its grace leaves the same bound.
        self.lease_record = LeaseRecord(record_path, grace.seconds, cfg.max_lease_ttl_s)
        self._table = LockTable(
            clock=loop.time,
            new_token=self.fence.next_token,
            max_locks=cfg.max_locks,
            max_waiters=cfg.max_waiters,
            max_locks_per_connection=cfg.max_locks_per_connection,
            max_waits_per_connection=cfg.max_waits_per_connection,
            auto_release_on_disconnect=cfg.auto_release_on_disconnect,
            grace_s=grace.seconds,
            note_lease=self.lease_record.note,
            lease_noted=self.lease_record.longest,
        )
        if grace.seconds > 0:
            log.warning(
                "restart grace: granting no key for %g s, until every lease the previous "
                "server may have granted has ended (%s); acquires wait or time out meanwhile",
                grace.seconds,
                grace.why,
            )
        else:
            log.info("restart grace: none (%s)", grace.why)
        self.snapshots = RationedSnapshots(loop, self.stats_reply)
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = asyncio.Event()
        # TLS or not, the loop sees plain TCP: a TLS connection's session is its own (tls.py).
        self._listener = await loop.create_server(
            lambda: Connection(self), cfg.host, cfg.port, reuse_address=True, backlog=c.BACKLOG
        )
        for sock in self._listener.sockets:  # accepted connections inherit them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, c.SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, c.SOCKET_BUFFER_BYTES)
        self._timers = [
            loop.call_later(cfg.lease_sweep_interval_s, self._sweep),
            loop.call_later(cfg.gc_interval_s, self._gc),
        ]
        if grace.seconds > 0:
            self._timers.append(loop.call_later(grace.seconds, self._grace_over))
        if cfg.metrics_port is not None:
            exporter = MetricsExporter(self, loop)
            try:
                exporter.start(cfg.metrics_host or cfg.host, cfg.metrics_port)
            except BaseException:
                self._listener.close()
                for timer in self._timers:
                    timer.cancel()
                raise
            self.metrics = exporter
            self.request_times = RequestTimes()

    async def _stop_accepting(self, listener: asyncio.Server) -> None:
        """Stop accepting, and let the connections accepted last get their transports before
        the listener closes.

        On asyncio's own loop (Python 3.11), a connection accepted in the turn before
        ``close()`` gets its transport a turn later; after ``close()`` the transport's
        constructor fails (``Server._attach`` asserts the server is open), and the loop drops
        the error ("Error on transport creation", logged in debug mode only) without closing
        the socket. Under a storm of new connections, a stopped embedded server left over a
        thousand sockets for the garbage collector. Here those connections get their
        transports first and are refused (the server is draining) and closed. uvloop does
        not have the problem."""
        loop = self.loop
        if not isinstance(loop, asyncio.SelectorEventLoop):
            return
        for sock in listener.sockets:
            loop.remove_reader(sock.fileno())
        for _ in range(2):  # the accepting turn may come after this one in the same pass
            await asyncio.sleep(0)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where ``/metrics`` is served, or ``None`` when metrics are off."""
        return self.metrics.address if self.metrics is not None else None

    async def serve_forever(self) -> None:
        """Serve until ``stop()`` has finished."""
        if self._stopped is None:
            await self.start()
        assert self._stopped is not None
        await self._stopped.wait()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Graceful shutdown: grant nothing more (acquires get ``error_draining``), let holders
        renew and release until none is left or ``shutdown_timeout_s`` ran out, then close
        every connection. ``timeout_s`` overrides ``shutdown_timeout_s`` (0: close at once)."""
        if self._stopped is None:
            return
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self.draining = True
        if self._listener is not None:
            await self._stop_accepting(self._listener)
            self._listener.close()
        # Nothing more is granted: blocked acquires and queued two-phase waiters are refused
        # now (not granted in the last moments before exit); holders keep renewing and
        # releasing until they are done or the shutdown timeout runs out.
        table = self.table
        for conn in list(self.connections):
            conn.refuse_wait()
        refused = table.drop_queued()
        timeout_s = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        log.info(
            "draining: %d lock(s) held, %d waiter(s) refused; waiting up to %gs for releases",
            table.held,
            refused,
            timeout_s,
        )
        deadline = self.loop.time() + timeout_s
        while table.held and self.connections and self.loop.time() < deadline:
            await asyncio.sleep(c.DRAIN_POLL_S)
        if table.held and self.connections:
            log.info("shutdown timeout reached with %d lock(s) held", table.held)
        for timer in self._timers:
            timer.cancel()
        if self.snapshots is not None:
            self.snapshots.flush()  # a last snapshot for whoever still waits for one
        for conn in list(self.connections):
            conn.drain_now()
        # Let the transports deliver their last bytes and report connection_lost.
        for _ in range(3):
            await asyncio.sleep(0)
        settled_by = self.loop.time() + c.STOP_SETTLE_S
        while self.open_transports and self.loop.time() < settled_by:
            await asyncio.sleep(c.STOP_SETTLE_POLL_S)
        if self._listener is not None:
            await self._listener.wait_closed()
        if self.metrics is not None:
            await self.loop.run_in_executor(None, self.metrics.stop)
        self._stopped.set()

    # ------------------------------------------------------------------ bookkeeping
    def admit(self, conn: Connection) -> str | None:
        """Register a new connection, or say why it is refused."""
        refusal = self._refusal(conn)
        if refusal is not None:
            self.connections_refused += 1
            return refusal
        self.connections_accepted += 1
        self.per_ip[conn.ip] = self.per_ip.get(conn.ip, 0) + 1
        self.connections.add(conn)
        return None

    def _refusal(self, conn: Connection) -> str | None:
        cfg = self.config
        if self.draining:
            return "server draining"
        if cfg.max_connections and len(self.connections) >= cfg.max_connections:
            return f"max_connections ({cfg.max_connections}) reached"
        count = self.per_ip.get(conn.ip, 0)
        if cfg.max_connections_per_ip and count >= cfg.max_connections_per_ip:
            return f"max_connections_per_ip ({cfg.max_connections_per_ip}) reached"
        return None

    def forget(self, conn: Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            count = self.per_ip.get(conn.ip, 0) - 1
            if count > 0:
                self.per_ip[conn.ip] = count
            else:
                self.per_ip.pop(conn.ip, None)

    def handshake_started(self, conn: Connection) -> None:
        """``conn`` begins its TLS handshake. Past ``max_tls_handshakes`` under way, the
        oldest is dropped: connections that never finish theirs cannot crowd out new ones
        (a real client finishes in a round trip or two), and their memory stays bounded."""
        cap = self.config.max_tls_handshakes
        if cap and len(self.handshaking) >= cap:
            oldest = next(iter(self.handshaking))
            del self.handshaking[oldest]
            self.handshakes_evicted += 1
            log.debug(
                "connection %s: dropped in its TLS handshake (max_tls_handshakes %d under way)",
                oldest.peer,
                cap,
            )
            oldest.abort()
        self.handshaking[conn] = None

    def handshake_ended(self, conn: Connection) -> None:
        """``conn``'s handshake is done, failed or was cut off."""
        self.handshaking.pop(conn, None)

    def busy_changed(self, busy: bool) -> None:
        self._busy += 1 if busy else -1
        if self._idle is not None:
            if self._busy:
                self._idle.clear()
            else:
                self._idle.set()

    def fragment_delay(self, earlier: int) -> float:
        """How long a dripping sender goes unread after ``earlier`` delays in a row: doubling
        from ``FRAGMENT_READ_DELAY_S`` up to the cap, jittered so that drippers delayed
        together are not read again together."""
        delay = min(c.FRAGMENT_READ_DELAY_S * 2 ** min(earlier, 16), self._fragment_delay_cap)
        return delay * self._jitter.uniform(_JITTER_MIN, _JITTER_MAX)

    def stats(self) -> dict[str, Any]:
        return self.table.stats(len(self.connections))

    def stats_reply(self) -> bytes:
        """A ``stats`` reply: a snapshot of the table, now."""
        return p.reply_stats(json.dumps(self.stats(), separators=(",", ":")))

    def _sweep(self) -> None:
        self._timers[0] = self.loop.call_later(self.config.lease_sweep_interval_s, self._sweep)
        try:
            self.table.expire()
        except FenceStateError as exc:
            log.error("cannot issue a token to a waiter after a lease expired: %s", exc)

    def _grace_over(self) -> None:
        table = self.table
        waiting = sum(state.n_waiting for state in table.keys.values())
        try:
            remaining = table.grace_remaining()  # at its end, grants the waiters queued in it
        except FenceStateError as exc:
            log.error("cannot issue a token to a waiter after the restart grace: %s", exc)
            return  # the sweep grants them once a token can be issued
        if remaining > 0:  # a timer may fire a hair early
            self._timers.append(self.loop.call_later(remaining, self._grace_over))
            return
        log.info("restart grace over: granting keys (%d waiter(s) were queued)", waiting)

    def _gc(self) -> None:
        self._timers[1] = self.loop.call_later(self.config.gc_interval_s, self._gc)
        pruned = self.table.gc(self.config.gc_max_idle_s)
        if pruned:
            log.debug("pruned %d idle key(s)", pruned)
