"""One client connection's request loop: a ``Connection`` has a ``stream.Stream`` (the bytes)
and, once admitted, a ``dispatch.Session`` (the requests). It answers its requests in order,
batched into one write per pass; a blocking acquire, or a request parked for a longer lease
bound (``RaiseBound``), holds up the requests behind it on that connection only. Its concerns:
passes and their budget, waits and their timers, what dispatch asks instead of a reply
(``Session.action``), the client's EOF, and shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol, cast

from dflockd_server import constants as c, protocol as p
from dflockd_server.config import Config
from dflockd_server.dispatch import AUTH_FAILED, STATS, Close, Host, RaiseBound, Session, Wait
from dflockd_server.leasebound import LeaseBound
from dflockd_server.metrics import RequestTimes
from dflockd_server.snapshots import RationedSnapshots
from dflockd_server.stream import Stream
from dflockd_server.table import LockTable, Waiter

__all__ = ["Connection", "ServerSide"]

log = logging.getLogger("dflockd_server")


class ServerSide(Protocol):
    """What a connection uses of its server (``net.Server``)."""

    config: Config
    request_times: RequestTimes | None
    snapshots: RationedSnapshots | None
    lease_bound: LeaseBound | None

    @property
    def table(self) -> LockTable: ...

    def admit(self, conn: Connection) -> str | None: ...

    def transport_lost(self) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection: ``host`` is ``server`` as its session sees it."""

    __slots__ = (
        "auth_failed_at",
        "budget",
        "eof",
        "host",
        "loop",
        "server",
        "session",
        "stream",
        "untold",
        "untold_in",
        "wait_command",
        "wait_started",
        "wait_timer",
        "waiter",
    )

    def __init__(self, server: ServerSide, host: Host, stream: Stream) -> None:
        self.server = server
        self.host = host
        self.stream = stream
        self.loop = stream.loop
        self.session: Session | None = None  # once admitted
        self.budget = 0  # requests the pass under way may still answer
        self.auth_failed_at: float | None = None  # loop time of a wrong secret
        self.eof = False  # the client sent EOF: close once what it sent is answered
        self.waiter: Waiter | None = None
        self.wait_started = 0.0  # perf_counter() when the in-flight wait began (metrics on)
        self.wait_command = b""
        self.wait_timer: asyncio.TimerHandle | None = None
        self.untold: Waiter | None = None
        """The last waiter granted whose reply was held back for the journal (in
        ``untold_in``): freed if the transport closes before it leaves (``_free_untold``)."""
        self.untold_in: list[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: no isinstance check here.
        transport = cast(asyncio.Transport, transport)
        stream = self.stream
        stream.transport = transport
        stream.set_peer(transport.get_extra_info("peername"))
        if (refusal := self.server.admit(self)) is not None:
            log.debug("refused connection from %s: %s", stream.peer, refusal)
            stream.closing = True
            transport.close()
            return
        server = self.server
        config = server.config
        session = Session(
            self.host, server.table, config.default_lease_ttl_s, config.max_lease_ttl_s, stream.peer
        )
        session.ip, session.locks_per_ip = stream.ip, config.locks_per_ip or c.NO_CAP
        if (shares := session.grants.shares) is not None:
            shares.opened(session.client, stream.ip)  # --max-locks-per-ip
        self.session = session
        client = session.client
        stream.idle_ok = lambda: client.kept_by is not None
        client.close = stream.close
        stream.open(transport)
        log.debug("connection %d from %s", session.client.id, stream.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        # Closed by the peer unless this server closed it first (every such close sets
        # `closing`), which frees nothing early (LockTable.disconnect).
        stream = self.stream
        by_peer = self.eof or not stream.closing
        self.server.transport_lost()
        stream.lost()
        if self.waiter is not None:
            self.waiter.wake = None
        self._drop_wait()
        session = self.session
        if session is None:
            return
        self.session = None
        session.client.close = None  # (its stream's method: a cycle that kept its buffers)
        self._free_untold(session)
        session.close(by_peer=by_peer)
        if (shares := session.grants.shares) is not None:
            shares.closed(session.client, session.ip)
        if self.auth_failed_at is not None:
            # A wrong secret keeps its slot for the whole delay, also when the client hangs up:
            # else hanging up early would make guessing free of the connection caps.
            self.loop.call_at(
                self.auth_failed_at + c.AUTH_FAILURE_DELAY_S, self.server.forget, self
            )
        else:
            self.server.forget(self)
        log.debug(
            "connection %d from %s closed%s",
            session.client.id,
            stream.peer,
            f": {exc}" if exc else "",
        )

    def data_received(self, data: bytes) -> None:
        stream = self.stream
        if stream.closing:
            return
        stream.last_rx = stream.clock()
        tls = stream.tls
        if tls is not None:
            data = stream.decrypt(tls, data)
            if not data:
                if tls.peer_closed:
                    self._peer_closed()
                return
        framer = stream.framer
        before = framer.buffered()  # > 0: the end of an unfinished request was awaited
        framer.feed(data)
        if not stream.busy and not stream.more_scheduled:
            self._process()
            if before and framer.buffered() == before + len(data):
                if not stream.closing:
                    stream.delay_reading()  # a second read in a row that completed nothing
            elif stream.fragment_delays:
                stream.fragment_delays = 0
        elif framer.buffered() > c.MAX_PIPELINE_BUFFER:
            stream.update_reading()  # a blocking request or a later pass holds the rest up
        if tls is not None and tls.peer_closed:
            self._peer_closed()

    def _peer_closed(self) -> None:
        """The client ended its TLS session: as an EOF."""
        if not self.stream.closing and self.eof_received() is None:
            self.stream.close()

    def eof_received(self) -> bool | None:
        # Answer the requests already received (acquires tried once), then close (_end_if_eof).
        stream = self.stream
        if stream.closing:
            return None
        self.eof = True  # the peer's close, also when the connection closes at once
        if stream.busy:
            return None  # a wait in flight: the client is gone (a killed process's FIN)
        if self.session is not None:
            self.session.eof = True
        if stream.more_scheduled or stream.framer.buffered():
            self._process_later()  # the transport stays open for the replies (plain TCP)
            return True
        return None

    def _end_if_eof(self) -> None:
        stream = self.stream
        if self.eof and not (
            stream.busy or stream.more_scheduled or stream.write_paused or stream.closing
        ):
            stream.close()

    def pause_writing(self) -> None:
        self.stream.pause_writing()

    def resume_writing(self) -> None:
        stream = self.stream
        stream.write_paused = False
        if stream.write_timer is not None:
            stream.write_timer.cancel()
            stream.write_timer = None
        if not stream.busy and stream.framer.buffered():
            self._process_later()
        elif self.eof:
            self._end_if_eof()
            return
        stream.update_reading()

    def _done_waiting(self, reply: bytes) -> None:
        """A blocking request got its answer: send it, then carry on with pipelined ones."""
        stream = self.stream
        self._drop_wait()
        stream.last_rx = stream.clock()
        times = self.server.request_times
        if times is not None and self.wait_command:
            times.observe(self.wait_command, time.perf_counter() - self.wait_started)
            self.wait_command = b""
        stream.write(reply)
        if stream.framer.buffered():
            self._process_later()
        elif self.eof:
            self._end_if_eof()
        else:
            stream.update_reading()

    def _process_later(self) -> None:
        stream = self.stream
        if not stream.more_scheduled:
            stream.more_scheduled = True
            self.loop.call_soon(self._process)

    def _process(self) -> None:
        """Answer buffered requests in order until one blocks, the buffer runs dry, the
        client stops reading, or the pass's budget (``MAX_REQUESTS_PER_PASS``, or one
        ``stats``) is spent. Replies are batched into one write per pass."""
        stream = self.stream
        stream.more_scheduled = False
        out: list[bytes] = []
        pending = 0
        framer = stream.framer
        transport = stream.transport
        session = self.session
        if session is None:
            return
        times = self.server.request_times
        self.budget = c.MAX_REQUESTS_PER_PASS
        while not stream.busy and not stream.closing and not stream.write_paused:
            if self.budget <= 0:
                if framer.buffered():
                    self._process_later()
                break
            self.budget -= 1
            try:
                frame = framer.next_frame()
            except p.LineTooLong:
                log.debug("connection %s: request line too long, closing", stream.peer)
                framer.clear()
                out.append(p.REPLY_ERROR)
                stream.close_with(b"".join(out))
                return
            if frame is None:
                break
            if times is None:
                reply = session.handle(frame)
                if reply is None:
                    reply = self._act(session)
                    if reply is None:
                        continue
            else:
                started = time.perf_counter()
                reply = session.handle(frame)
                if reply is None:
                    reply = self._act(session)
                if reply is not None:
                    times.observe(frame[0], time.perf_counter() - started)
                else:
                    if self.waiter is not None:
                        self.wait_started, self.wait_command = started, frame[0]
                    continue
            out.append(reply)
            pending += len(reply)
            if pending >= c.WRITE_BUFFER_LOW_WATER and transport is not None:
                stream.send(transport, b"".join(out))  # may call pause_writing
                out.clear()
                pending = 0
        if out and transport is not None and not transport.is_closing():
            stream.send(transport, out[0] if len(out) == 1 else b"".join(out))
        if self.eof:
            self._end_if_eof()
            return
        if stream.reading_paused or stream.write_paused or stream.busy or stream.more_scheduled:
            stream.update_reading()

    def _act(self, session: Session) -> bytes | None:
        """Carry out ``session.action``; the reply, if there is one now."""
        action = session.action
        session.action = None
        stream = self.stream
        if isinstance(action, Wait):
            self.waiter = waiter = action.waiter
            waiter.wake = self._granted
            stream.busy = True
            self.wait_timer = self.loop.call_later(action.timeout, self._wait_timed_out)
            return None
        if isinstance(action, Close):
            stream.close_with(action.reply)
            return None
        if isinstance(action, RaiseBound):
            bound = self.server.lease_bound
            assert bound is not None  # the table asks for no bound without one
            stream.busy = True
            if self.server.request_times is not None:  # timed to its answer, as a wait is
                self.wait_started, self.wait_command = time.perf_counter(), action.frame[0]
            bound.wait_for(action.lease, lambda refusal: self._bound_recorded(action, refusal))
            return None
        if action is STATS:
            self.budget = 0  # its cost grows with the table: the last request of the pass
            snapshots = self.server.snapshots
            assert snapshots is not None
            reply = snapshots.request(self)
            if reply is None:
                stream.busy = True  # answered with the next snapshot (stats_ready)
            return reply
        assert action is AUTH_FAILED, action
        stream.busy = True
        self.auth_failed_at = self.loop.time()
        self.loop.call_later(c.AUTH_FAILURE_DELAY_S, stream.close_with, p.REPLY_ERROR_AUTH)
        return None

    def _bound_recorded(self, parked: RaiseBound, refusal: bytes | None) -> None:
        """The lease bound ``parked`` waited for is recorded, or ``refusal`` is its answer."""
        session = self.session
        if session is None or self.stream.closing:
            return
        if refusal is not None:
            self._done_waiting(refusal)
            return
        session.asking = parked.asking  # answered as if it had just arrived
        reply = session.handle(parked.frame)
        if reply is None:
            reply = self._act(session)
            if reply is None:
                return  # it waits again (a queued acquire), or the connection closes
        self._done_waiting(reply)

    def _granted(self, waiter: Waiter) -> None:
        session = self.session
        if session is None:
            return
        stream = self.stream
        transport = stream.transport
        reply = session.granted(waiter)
        if stream.closing or transport is None or transport.is_closing():
            # Nobody can be told of the grant: it ends now, not when its lease runs out.
            self._drop_wait()
            self._free_grant(session, waiter)
            return
        self._done_waiting(reply)
        if stream.held is not None:  # held back until the journal is written (GroupWrite)
            self.untold, self.untold_in = waiter, stream.held
        elif self.untold is not None:
            self.untold = self.untold_in = None

    def _drop_wait(self) -> None:
        self.waiter = None
        if self.wait_timer is not None:
            self.wait_timer.cancel()
            self.wait_timer = None
        self.stream.busy = False

    def _free_grant(self, session: Session, waiter: Waiter) -> None:
        """Free the grant made to ``waiter``, whose reply will never be sent."""
        holder = waiter.holder
        if holder is not None and holder.live:
            log.debug(
                "connection %s: granted %r as it closed, reply unsent: released",
                self.stream.peer,
                holder.key,
            )
            session.table.release(holder.key, holder.token)

    def _free_untold(self, session: Session) -> None:
        """The transport is gone: free the ``untold`` grant if its reply never left."""
        waiter = self.untold
        if waiter is not None:
            untold_in = self.untold_in
            self.untold = self.untold_in = None
            if self.stream.held is untold_in or self.stream.unsent is untold_in:
                self._free_grant(session, waiter)

    def _wait_timed_out(self) -> None:
        self.wait_timer = None
        waiter, session = self.waiter, self.session
        if waiter is not None and session is not None:
            self.answer_wait(session.timed_out(waiter))

    def answer_wait(self, reply: bytes) -> None:
        """Answer a blocked acquire with ``reply`` now; the connection stays open."""
        waiter = self.waiter
        if waiter is not None and self.session is not None:
            self.session.give_up(waiter)
            self._done_waiting(reply)

    def stats_ready(self, reply: bytes) -> None:
        if not self.stream.closing:
            self._done_waiting(reply)

    def drain_now(self) -> None:
        """Shutdown deadline: answer an in-flight wait with ``error_draining`` and close."""
        waiter, session = self.waiter, self.session
        if waiter is not None and session is not None:
            session.give_up(waiter)
            self._drop_wait()
            self.stream.close_with(p.REPLY_ERROR_DRAINING)
        else:
            self.stream.close()
