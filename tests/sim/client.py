"""A simulated client process: the real lock core and client session, the shell's loops.

Each client runs one workload: acquire a lock on one of a few keys, hold it a while (renewing,
its session kept alive), release it, again. What it decides, it decides with the client's own
code: ``LockCore`` builds every request and reads every reply, says when a grant is renewed,
lost, or must be reattached by token; ``ClientSession`` says how long its session surely lives.
What is the simulator's own is the shell around them, written after
``celery_dflock/client/_async/held.py`` (renewal, reattach, release), ``keepalive.py`` (the
session's keep-alive) and ``connection.py`` (a connection's ``hello`` and join); a connection
whose request gets no answer in its time is closed, as theirs is. Each attempt is recorded as a
``tests.faults.history.Hold``, on the run's (global) clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from celery_dflock.client import _replies, _requests
from celery_dflock.client._core import LockCore
from celery_dflock.client._grant import LockState
from celery_dflock.client._replies import Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._servers import ServerInfo, server_info
from celery_dflock.client._session import ClientSession
from celery_dflock.client._settings import ClientSettings
from celery_dflock.client.errors import DflockError
from tests.faults.history import Hold
from tests.sim.loop import Loop, Timer
from tests.sim.network import Conn
from tests.sim.process import Process

__all__ = ["ClientConn", "SimClient"]

Answer = Callable[[Reply | None], None]
"""Told the reply to a request, or None: no answer (timed out, or the connection closed)."""


class ClientConn:
    """The client's side of one connection: requests answered in order, each with its time."""

    def __init__(self, client: SimClient) -> None:
        self.client = client
        self.conn: Conn | None = None
        self.pending: deque[tuple[Command, Answer, Timer]] = deque()
        self.gone = False
        self.session: ClientSession | None = None
        self.on_close: list[Callable[[], None]] = []
        self.address = ""
        """The server it goes to (a cluster's member: ``HOST:PORT``)."""

    def request(self, command: Command, data: bytes, timeout: float, answer: Answer) -> None:
        conn = self.conn
        if self.gone or conn is None:
            self.client.proc.later(0.0, lambda: answer(None))
            return
        timer = self.client.proc.later(timeout, self._timed_out)
        self.pending.append((command, answer, timer))
        conn.to_server(data)

    def _timed_out(self) -> None:
        self.client.loop.note(f"{self.client.name}: a request timed out: closing")
        self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close_by_client()
        self._gone()

    def _gone(self) -> None:
        if self.gone:
            return
        self.gone = True
        pending, self.pending = self.pending, deque()
        for _, answer, timer in pending:
            timer.cancel()
            answer(None)
        for told in self.on_close:
            told()

    # network.Endpoint
    def received(self, conn: Conn, data: bytes) -> None:
        for line in data.split(b"\n"):
            if not line or not self.pending:
                continue
            command, answer, timer = self.pending.popleft()
            timer.cancel()
            try:
                reply = self.client.decode(command, line)
            except DflockError:
                self.close()
                return
            answer(reply)

    def closed(self, conn: Conn, *, reset: bool) -> None:
        self._gone()


@dataclass
class Attempt:
    """One acquire attempt under way (becomes a ``Hold``)."""

    key: str
    requested_t: float
    lease: float
    fence: int | None = None
    enqueued_t: float | None = None
    session_ttl: float | None = None
    """In a client session: the lease or the session's time, the shorter."""
    keepalive_t: list[tuple[float, float]] = field(default_factory=list[tuple[float, float]])
    """(send time, answer time) of the session's keep-alives answered while it was held."""
    granted_t: float | None = None
    released_t: float | None = None
    release_ok: bool = False
    renewed_t: list[float] = field(default_factory=list[float])
    told_t: float | None = None
    outcome: str = ""

    def hold(self, client: str, outcome: str, holding_until: float | None = None) -> Hold:
        renewed = self.renewed_t
        if self.session_ttl is not None:
            # A keep-alive answered while the grant was surely held renewed it (the server
            # renews what it still holds when the keep-alive comes): from its send time, for
            # the lease or the session's time, the shorter. Expressed as renewals for
            # ``Hold.valid_until`` (each ``r`` proving ``r + lease``).
            ttl = self.session_ttl
            proven = self.requested_t + self.lease
            renewed = []
            for sent, answered in self.keepalive_t:
                if answered < proven and sent + ttl > proven:
                    proven = sent + ttl
                    renewed.append(sent + ttl - self.lease)
        return Hold(
            key=self.key,
            client=client,
            requested_t=self.requested_t,
            lease_s=self.lease,
            outcome=outcome,
            fence=self.fence,
            granted_t=self.granted_t,
            enqueued_t=self.enqueued_t,
            released_t=self.released_t,
            release_ok=self.release_ok,
            renewed_t=tuple(renewed),
            holding_until=holding_until,
            reported_lost=self.told_t is not None,
            told_t=self.told_t,
        )


class SimClient:
    """One client process and its workload (see the module's doc)."""

    def __init__(
        self,
        loop: Loop,
        proc: Process,
        connect: Callable[[SimClient, Callable[[ClientConn | None, bool], None]], None],
        ip: str,
        keys: list[str],
        holds: list[Hold],
    ) -> None:
        self.loop = loop
        self.proc = proc
        self.name = proc.name
        self.ip = ip
        self.keys = keys
        self.holds = holds
        self._connect = connect
        self.settings = ClientSettings.checked(servers=[("sim", 6388)], connect_timeout_s=5.0)
        self.endpoint = self.settings.endpoints()[0]
        self.info: ServerInfo | None = None
        self.session: ClientSession | None = None
        self.sessions_made = 0
        self.conn: ClientConn | None = None
        self.core: LockCore | None = None
        self.attempt: Attempt | None = None
        self.renew_timer: Timer | None = None
        self.keeping: ClientSession | None = None
        self.ka_conn: ClientConn | None = None
        self.detached_holds = False
        """Some of its acquires are detached holds (``hl ... d``)."""
        self.aim = ""
        """The member its next connection goes to (a cluster's client: ``HOST:PORT``)."""

    def decode(self, command: Command, line: bytes) -> Reply:
        """A reply line read (``protocol.decode_reply``)."""
        return _replies.decode_reply(command, line)

    # ------------------------------------------------------------------ times
    def clock(self) -> float:
        return self.proc.clock()

    def global_t(self, local: float) -> float:
        """A time of this process's clock on the run's clock."""
        return local - self.proc.clock_offset

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.info = None
        self.session = None
        self.conn = None
        self.core = None
        self.attempt = None
        self.keeping = None
        self.ka_conn = None
        self._next_attempt()

    def kill(self) -> None:
        """The process is killed: its kernel resets its connections; its attempt ends."""
        attempt = self.attempt
        if attempt is not None:
            if attempt.granted_t is None:
                self.holds.append(attempt.hold(self.name, "error"))
            elif attempt.released_t is not None:
                self.holds.append(attempt.hold(self.name, "lost"))
            else:
                self.holds.append(attempt.hold(self.name, "killed", holding_until=self.loop.now))
        self.attempt = None
        self.core = None
        for conn in (self.conn, self.ka_conn):
            if conn is not None and conn.conn is not None:
                conn.conn.close_by_client(reset=True)
        self.conn = self.ka_conn = None

    def _next_attempt(self) -> None:
        self.proc.later(self.loop.uniform(0.0, 2.0), self._acquire)

    # ------------------------------------------------------------------ connections
    def _session_for(self, info: ServerInfo) -> ClientSession:
        """``Sessions.current``: the live session, or a new one (its id from the run's seed)."""
        session = self.session
        ttl = info.session_ttl(self.endpoint.session_ttl_s)
        if session is None or not session.live() or session.ttl != ttl:
            session = ClientSession(ttl, clock=self.clock)
            self.sessions_made += 1
            session.id = f"{self.loop.rng.getrandbits(128):032x}"
            self.session = session
        return session

    def connect(self, done: Callable[[ClientConn | None, bool], None]) -> None:
        """``AsyncConnection.connect``: a connection that said ``hello`` and joined the session;
        ``done(None, refused)`` when it could not be made."""

        def made(conn: ClientConn | None, refused: bool) -> None:
            if conn is None:
                done(None, refused)
                return
            if self.info is None:
                self._hello(conn, done)
            else:
                self._join(conn, done)

        self._connect(self, made)

    def _hello(self, conn: ClientConn, done: Callable[[ClientConn | None, bool], None]) -> None:
        def answered(reply: Reply | None) -> None:
            if reply is None:
                done(None, False)
                return
            try:
                self.info = server_info(self.endpoint, reply)
            except DflockError:
                conn.close()
                done(None, False)
                return
            self._join(conn, done)

        conn.request(Command.HELLO, _requests.HELLO_REQUEST, 10.0, answered)

    def _join(self, conn: ClientConn, done: Callable[[ClientConn | None, bool], None]) -> None:
        info = self.info
        assert info is not None
        if not info.keeps_sessions:
            done(conn, False)
            return
        session = self._session_for(info)
        sent = self.clock()

        def answered(reply: Reply | None) -> None:
            if reply is None:
                done(None, False)
                return
            joined = server_info(self.endpoint, reply)
            if isinstance(reply, _replies.Hello):
                session.durable = joined.supports("durable")
                session.run = joined.run
                session.answered(sent)
                conn.session = session
            done(conn, False)

        conn.request(
            Command.HELLO, _requests.encode_join_session(session.id, session.ttl), 5.0, answered
        )

    # ------------------------------------------------------------------ acquire
    def _acquire(self) -> None:
        rng = self.loop.rng
        key = rng.choice(self.keys)
        lease = rng.choice([None, 4, 8, 15])
        timeout = rng.choice([0, 2, 10])
        core = LockCore(key, self.settings, acquire_timeout_s=timeout, lease_ttl_s=lease)
        core.grant.clock = self.clock
        self.core = core
        self.attempt = Attempt(key, self.loop.now, lease or 12)
        conn = self.conn
        if conn is not None and not conn.gone:
            self._send_acquire(conn, core)
            return

        def connected(conn: ClientConn | None, refused: bool) -> None:
            if self.core is not core:
                return
            if conn is None:
                self._finish("error")
                return
            self.conn = conn
            self._send_acquire(conn, core)

        self.connect(connected)

    def _send_acquire(self, conn: ClientConn, core: LockCore) -> None:
        core.begin_acquire()
        detached = self.detached_holds and self.loop.chance(0.5) and self.info is not None
        if not detached and self.info is not None and self.loop.chance(0.3):
            self._enqueue(conn, core)
            return
        if detached:
            command, data, timeout = core.hold_request(self.info, "sim", detached=True)
        else:
            command, data, timeout = core.acquire_request(self.info)
        sent = self.clock()
        self.loop.note(f"{self.name}: {data!r} on {conn.conn.id if conn.conn else '-'}")

        def answered(reply: Reply | None) -> None:
            if self.core is not core:
                return
            if reply is None:
                self._finish("error")
                return
            try:
                session = None if detached else conn.session
                held = core.on_grant_reply(command, reply, sent, self.info, session)
            except DflockError:
                self._finish("error")
                return
            if not held:
                self._finish("timeout")
                return
            self._granted(conn, core, detached=detached)

        conn.request(command, data, timeout, answered)

    def _enqueue(self, conn: ClientConn, core: LockCore) -> None:
        """Two-phase: ``e`` (join the queue), then ``w`` on the same connection."""
        command, data, timeout = core.enqueue_request(self.info)
        sent = self.clock()
        self.loop.note(f"{self.name}: {data!r} on {conn.conn.id if conn.conn else '-'}")

        def enqueued(reply: Reply | None) -> None:
            if self.core is not core:
                return
            if reply is None:
                self._finish("error")
                return
            try:
                held = core.on_grant_reply(command, reply, sent, self.info, conn.session)
            except DflockError:
                self._finish("error")
                return
            attempt = self.attempt
            assert attempt is not None
            if held:
                attempt.enqueued_t = self.loop.now
                self._granted(conn, core)
            elif core.state is LockState.ENQUEUED:
                attempt.enqueued_t = self.loop.now
                self._wait(conn, core)
            else:
                self._finish("timeout")

        conn.request(command, data, timeout, enqueued)

    def _wait(self, conn: ClientConn, core: LockCore) -> None:
        command, data, timeout = core.wait_request(self.loop.rng.choice([0, 2, 10]))
        sent = self.clock()

        def answered(reply: Reply | None) -> None:
            if self.core is not core:
                return
            if reply is None:
                self._finish("error")
                return
            try:
                held = core.on_grant_reply(command, reply, sent, self.info, conn.session)
            except DflockError:
                self._finish("error")
                return
            if held:
                self._granted(conn, core)
            else:
                self._finish("timeout")

        conn.request(command, data, timeout, answered)

    def _granted(self, conn: ClientConn, core: LockCore, *, detached: bool = False) -> None:
        attempt = self.attempt
        assert attempt is not None and core.grant.token is not None
        attempt.granted_t = self.loop.now
        attempt.fence = _requests.fence_of(core.grant.token)
        attempt.lease = core.grant.lease
        session = core.grant.session
        if session is not None:
            # In a client session the server may end the grant with its session, before its
            # lease: proven only while the session surely lives (its last join or keep-alive
            # sent before the request, plus its time), and from each keep-alive answered.
            requested = attempt.requested_t + self.proc.clock_offset
            attempt.lease = max(
                0.0, min(core.grant.lease, session.answered_at + session.ttl - requested)
            )
            attempt.session_ttl = min(core.grant.lease, session.ttl)
        self.loop.note(f"{self.name}: granted {core.key} fence {attempt.fence}")
        if detached:  # a detached hold (``Client.hold``): no renewal, let go by token
            self.loop.note(f"{self.name}: detached hold of {core.key}")
            self.proc.later(
                self.loop.uniform(0.0, 0.7 * core.grant.lease), lambda: self._release(core)
            )
            return
        session = core.grant.session
        if session is not None:
            session.hold(_Holding(self, core), lambda: self._start_keeping(session))
        self._schedule_renewal(core.first_renewal_in())
        self.proc.later(self.loop.uniform(0.0, 30.0), lambda: self._release(core))

    # ------------------------------------------------------------------ renewal
    def _schedule_renewal(self, delay: float) -> None:
        if self.renew_timer is not None:
            self.renew_timer.cancel()
        self.renew_timer = self.proc.later(delay, self._renew_tick)

    def _lost(self, core: LockCore, why: str) -> None:
        if core.mark_lost(why) and self.attempt is not None and self.core is core:
            self.attempt.told_t = self.loop.now
            self.loop.note(f"{self.name}: lost {core.key}: {why}")

    def _renew_tick(self) -> None:
        """``AsyncHolding.renew_once``."""
        core = self.core
        if core is None or core.state is not LockState.HELD or core.lost:
            return
        ended = core.grant.session_ended()
        if ended is not None:
            self._lost(core, ended)
            return
        conn = self.conn
        if conn is not None and not conn.gone and core.grant.kept_alive():
            # ``_sync_backend.RenewalDriver._due``: looked at again shortly before the lease
            # the keep-alives keep would end
            self._schedule_renewal(core.next_look_in())
            return
        if conn is None or conn.gone:
            core.connection_broke("the server closed it")
            self._reattach(core)
            return
        self._renew_on(conn, core)

    def _renew_on(self, conn: ClientConn, core: LockCore) -> None:
        command, data, timeout = core.renew_request()
        sent = self.clock()

        def answered(reply: Reply | None) -> None:
            if self.core is not core or core.state is not LockState.HELD or core.lost:
                return
            if reply is None:
                core.connection_broke("no answer to a renewal")
                self._pause_reattach(core, "no answer")
                return
            outcome = core.on_renew_reply(reply, sent, conn.session)
            if outcome.renewed:
                if self.attempt is not None and core.grant.session is None:
                    self.attempt.renewed_t.append(self.global_t(sent))
                self.conn = conn
                self._schedule_renewal(core.renew_interval())
            elif outcome.reattach:
                core.connection_broke(outcome.lost_reason or "draining")
                self._pause_reattach(core, outcome.lost_reason or "draining")
            else:
                self._lost(core, outcome.lost_reason or "renewal refused")

        conn.request(command, data, timeout, answered)

    def _reattach(self, core: LockCore) -> None:
        """``AsyncHolding._reattach``: a new connection, the grant renewed by token on it."""
        if self.core is not core or core.state is not LockState.HELD or core.lost:
            return
        ended = core.grant.session_ended()
        if ended is not None:
            self._lost(core, ended)
            return
        if core.grant.lease_left() <= 0:
            if core.mark_unreachable():
                self._lost(core, "unreachable")
            if self.attempt is not None and self.attempt.told_t is None:
                self.attempt.told_t = self.loop.now
            return

        def connected(conn: ClientConn | None, refused: bool) -> None:
            if self.core is not core or core.state is not LockState.HELD or core.lost:
                return
            if conn is None:
                if refused:
                    core.grant.refused()
                self._pause_reattach(core, "unreachable")
                return
            self._renew_on(conn, core)

        self.connect(connected)

    def _pause_reattach(self, core: LockCore, detail: str) -> None:
        wait = core.grant.reattach_pause(detail)
        if wait is None:
            core.mark_unreachable()
            if self.attempt is not None and self.attempt.told_t is None and core.lost:
                self.attempt.told_t = self.loop.now
            return
        self.proc.later(wait, lambda: self._reattach(core))

    # ------------------------------------------------------------------ release
    def _release(self, core: LockCore) -> None:
        if self.core is not core:
            return
        if self.renew_timer is not None:
            self.renew_timer.cancel()
        if core.lost or core.state is not LockState.HELD:
            core.reset()
            self._finish("lost")
            return
        command, data, timeout = core.release_request()
        attempt = self.attempt
        assert attempt is not None

        def send(conn: ClientConn) -> None:
            attempt.released_t = self.loop.now

            def answered(reply: Reply | None) -> None:
                if self.core is not core:
                    return
                if reply is None:
                    core.reset()
                    self._finish("lost")
                    return
                attempt.release_ok = core.on_release_reply(reply)
                core.reset()
                self._finish("released" if attempt.release_ok else "lost")

            conn.request(command, data, timeout, answered)

        conn = self.conn
        if conn is not None and not conn.gone:
            send(conn)
            return

        def connected(conn: ClientConn | None, refused: bool) -> None:
            if self.core is not core:
                return
            if conn is None:
                core.reset()
                self._finish("lost")
                return
            self.conn = conn
            send(conn)

        self.connect(connected)

    def _finish(self, outcome: str) -> None:
        attempt = self.attempt
        if attempt is not None:
            if attempt.granted_t is None and outcome in {"lost", "released"}:
                outcome = "error"
            self.holds.append(attempt.hold(self.name, outcome))
        self.attempt = None
        self.core = None
        self._next_attempt()

    # ------------------------------------------------------------------ keep-alive
    def _start_keeping(self, session: ClientSession) -> object:
        self.proc.later(0.0, lambda: self._keep_tick(session))
        return session

    def _keep_tick(self, session: ClientSession) -> None:
        """One step of ``keepalive.keep_session_alive``."""
        if session.idle():
            return
        if not session.live():
            session.stopped()
            return
        now = self.clock()
        due = session.answered_at + session.interval()
        if now < due:
            self.proc.later(due - now, lambda: self._keep_tick(session))
            return
        conn = self.ka_conn
        if conn is None or conn.gone or conn.session is not session:

            def connected(conn: ClientConn | None, refused: bool) -> None:
                if conn is None:
                    if refused:
                        session.refused()
                    self.proc.later(0.25, lambda: self._keep_tick(session))
                    return
                self.ka_conn = conn
                self._keep_tick(session)

            self.connect(connected)
            return
        left = session.deadline() - self.clock()
        timeout = max(0.1, min(10.0, left))
        sent = self.clock()

        def answered(reply: Reply | None) -> None:
            if isinstance(reply, _replies.Ok):
                session.answered(sent, renewed=True)
                core = self.core
                attempt = self.attempt
                if (
                    attempt is not None
                    and core is not None
                    and core.grant.session is session
                    and core.grant.run is not None
                    and session.run == core.grant.run  # (a restart's session renews none)
                    and attempt.granted_t is not None
                ):
                    attempt.keepalive_t.append((self.global_t(sent), self.loop.now))
            elif reply is not None:
                session.end("the server refused its keep-alive")
            self._keep_tick(session)

        conn.request(Command.PING, _requests.encode_keepalive(session.id), timeout, answered)


class _Holding:
    """A held lock as its session sees it (``_session.Holder``)."""

    def __init__(self, client: SimClient, core: LockCore) -> None:
        self.client = client
        self.core = core

    def poke(self) -> None:
        self.client.proc.later(0.0, self.client._renew_tick)  # pyright: ignore[reportPrivateUsage]

    def holds(self) -> bool:
        core = self.core
        return self.client.core is core and core.state is LockState.HELD and not core.lost
