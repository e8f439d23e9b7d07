"""A simulated client process: the real lock core and client session, the shell's loops.

Each client runs one workload: acquire a lock on one of a few keys, hold it a while (renewing,
its session kept alive), release it, again. What it decides, it decides with the client's own
code: ``LockCore`` builds every request and reads every reply, says when a grant is renewed,
lost, or must be reattached by token; ``ClientSession`` says how long its session surely lives.
What is the simulator's own is the shell around them, written after
``celery_dflock/client/_async/held.py`` (renewal, reattach, release; a request that may wait
keeps its session alive; a grant made in a session that ended while it waited is confirmed:
the connection rejoins the current session and the grant is renewed by token before the
acquire returns, else abandoned), ``keepalive.py`` (a session's keep-alive), ``connection.py``
(a connection's ``hello`` and join: the session's time as the server cuts it, none where the
server keeps none a keep-alive can keep) and ``pool.py`` (one current session per server; an idle
connection whose session is over is not reused); a connection whose request gets no answer in
its time is closed, as theirs is. Each attempt is recorded as a ``tests.faults.history.Hold``,
on the run's (global) clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from celery_dflock.client import _replies, _requests, wire
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
    confirming: bool = False
    """Granted, its session over meanwhile: being confirmed (the acquire has not returned)."""
    granted_lease: float = 0.0
    """The lease the grant was made with."""
    cut: tuple[float, float] | None = None
    """(send time, lease) of the first renewal answered with a lease shorter than the one
    granted (a server restarted with a shorter ``--default-lease-ttl``), the lease the
    shortest answered since: from then on the server counts the grant at that lease."""
    proofs: list[tuple[float, float]] = field(default_factory=list[tuple[float, float]])
    """(send time, time proven from it) of every renewal and keep-alive answered while held."""

    def shortened(self, sent: float, lease: float) -> None:
        """A renewal sent at ``sent`` was answered with ``lease``, shorter than granted."""
        self.cut = (sent, lease) if self.cut is None else (self.cut[0], min(self.cut[1], lease))

    def proof(self) -> tuple[float, list[float]]:
        """The lease and the renewals ``Hold.valid_until`` proves the grant held by (each
        renewal ``r`` proving ``r + lease``)."""
        if self.cut is not None:
            # The cutting renewal was accepted at some moment after its send: the grant was
            # held until then and runs at least the cut lease from it. What came before it
            # proves nothing past it; what was sent after proves at most the cut lease.
            sent, cut = self.cut
            proven = sent + cut
            for at, span in self.proofs:
                if at >= sent:
                    proven = max(proven, at + min(span, cut))
            return proven - self.requested_t, []
        if self.session_ttl is None:
            return self.lease, list(self.renewed_t)
        # A keep-alive answered while the grant was surely held renewed it (the server renews
        # what it still holds when the keep-alive comes): from its send time, for the lease or
        # the session's time, the shorter.
        ttl = self.session_ttl
        proven = self.requested_t + self.lease
        renewed: list[float] = []
        for sent, answered in self.keepalive_t:
            if answered < proven and sent + ttl > proven:
                proven = sent + ttl
                renewed.append(sent + ttl - self.lease)
        return self.lease, renewed

    def proven_until(self) -> float:
        lease, renewed = self.proof()
        return max([self.requested_t, *renewed]) + lease

    def hold(self, client: str, outcome: str, holding_until: float | None = None) -> Hold:
        lease, renewed = self.proof()
        return Hold(
            key=self.key,
            client=client,
            requested_t=self.requested_t,
            lease_s=lease,
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
        connect: Callable[[SimClient, float, Callable[[ClientConn | None, bool], None]], None],
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
        self.sessions: dict[str, ClientSession] = {}
        """The current client session with each server, by address (``Sessions``)."""
        self.conn: ClientConn | None = None
        self.core: LockCore | None = None
        self.holding: _Holding | None = None
        self.attempt: Attempt | None = None
        self.renew_timer: Timer | None = None
        self.ka_conns: dict[str, ClientConn] = {}
        """Each session's keep-alive connection, by the session's id."""
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
        self.sessions = {}
        self.conn = None
        self.core = None
        self.holding = None
        self.attempt = None
        self.ka_conns = {}
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
        self.core = self.holding = None
        for conn in (self.conn, *self.ka_conns.values()):
            if conn is not None and conn.conn is not None:
                conn.conn.close_by_client(reset=True)
        self.conn = None
        self.ka_conns = {}

    def _next_attempt(self) -> None:
        self.proc.later(self.loop.uniform(0.0, 2.0), self._acquire)

    # ------------------------------------------------------------------ connections
    def _session_for(self, info: ServerInfo, address: str) -> ClientSession:
        """``Sessions.current``: the live session with ``address``, or a new one (its id from
        the run's seed)."""
        session = self.sessions.get(address)
        ttl = info.session_ttl(self.endpoint.session_ttl_s)
        if session is None or not session.live() or session.ttl != ttl:
            session = ClientSession(ttl, clock=self.clock)
            session.id = f"{self.loop.rng.getrandbits(128):032x}"
            self.sessions[address] = session
        return session

    def server_address(self) -> str:
        """Where the lock's requests go (one server: its only one)."""
        return self.endpoint.address

    def connect(self, done: Callable[[ClientConn | None, bool], None]) -> None:
        """A connection to the lock's server (`dial`)."""
        self.dial(self.server_address(), done)

    def dial(
        self,
        address: str,
        done: Callable[[ClientConn | None, bool], None],
        within: float | None = None,
    ) -> None:
        """``AsyncConnection.connect``: a connection to ``address`` that said ``hello`` and
        joined the current session there; ``done(None, refused)`` when it could not be made.
        ``within``: its endpoint's ``connect_timeout_s`` cut shorter (the keep-alive's)."""
        timeout = self.endpoint.connect_timeout_s if within is None else within

        def made(conn: ClientConn | None, refused: bool) -> None:
            if conn is None:
                done(None, refused)
                return
            conn.address = address
            if self.info is None or not self.info.keeps_sessions:
                # As `connect`: a connection that joins no session opts in with ``hello``,
                # whose answer tells what a restarted server keeps now.
                self._hello(conn, done, timeout)
            else:
                self._join(conn, done, timeout)

        self.aim = address
        self._connect(self, timeout, made)

    def _hello(
        self, conn: ClientConn, done: Callable[[ClientConn | None, bool], None], timeout: float
    ) -> None:
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
            self._join(conn, done, timeout)

        conn.request(Command.HELLO, _requests.HELLO_REQUEST, min(10.0, timeout), answered)

    def _join(
        self,
        conn: ClientConn,
        done: Callable[[ClientConn | None, bool], None],
        timeout: float = 5.0,
    ) -> None:
        """``AsyncConnection.rejoin``: ``conn`` joins the current session with its server (a
        new connection's, and a grant's confirmation)."""
        info = self.info
        assert info is not None
        if not info.keeps_sessions:
            done(conn, False)
            return
        session = self._session_for(info, conn.address)
        sent = self.clock()

        def answered(reply: Reply | None) -> None:
            if reply is None:
                done(None, False)
                return
            try:
                joined = server_info(self.endpoint, reply)
            except DflockError:
                conn.close()
                done(None, False)
                return
            if isinstance(reply, _replies.JsonReply):
                self.info = joined  # this run's: a restart may have changed its settings
                if not joined.keeps_sessions:  # restarted without them: in no session
                    conn.session = None
                    self._leave(conn, session, joined, done)
                    return
                session.durable = joined.supports(wire.FEATURE_DURABLE)
                session.run = joined.run
                session.answered(sent)
                session.ttl = joined.session_ttl(session.ttl)  # a restart may have cut it
                conn.session = session
            done(conn, False)

        data = _requests.encode_join_session(session.id, session.ttl)
        conn.request(Command.HELLO, data, min(5.0, timeout), answered)

    def _leave(
        self,
        conn: ClientConn,
        session: ClientSession,
        joined: ServerInfo,
        done: Callable[[ClientConn | None, bool], None],
    ) -> None:
        """``AsyncConnection.join`` on a server that keeps no session a keep-alive can keep:
        one cut below ``MIN_SESSION_TTL_S`` is ended at once; then a plain ``hello`` opts the
        connection in to the server's connection sessions."""
        steps: list[bytes] = []
        if joined.supports(wire.FEATURE_KEEPALIVE):
            steps.append(_requests.encode_join_session(session.id, 0))
        if joined.session_ttl_s is not None:
            steps.append(_requests.HELLO_REQUEST)

        def step(reply: Reply | None) -> None:
            if reply is None:
                done(None, False)
            elif steps:
                conn.request(Command.HELLO, steps.pop(0), 5.0, step)
            else:
                done(conn, False)

        step(_replies.Ok())

    # ------------------------------------------------------------------ acquire
    def _begin(self, core: LockCore, lease: int | None) -> None:
        """A new attempt with ``core`` (its holding, its record)."""
        core.grant.clock = self.clock
        self.core = core
        self.holding = _Holding(self, core)
        self.attempt = Attempt(core.key, self.loop.now, lease or 12)

    def _reusable(self, conn: ClientConn | None) -> bool:
        """``AsyncConnectionPool.checkout``'s look at an idle connection: open, and its client
        session live (one that fails is closed)."""
        if conn is None or conn.gone:
            return False
        if conn.session is None or conn.session.live():
            return True
        conn.close()
        return False

    def _acquire(self) -> None:
        rng = self.loop.rng
        key = rng.choice(self.keys)
        lease = rng.choice([None, 4, 8, 15])
        timeout = rng.choice([0, 2, 10])
        core = LockCore(key, self.settings, acquire_timeout_s=timeout, lease_ttl_s=lease)
        self._begin(core, lease)
        conn = self.conn
        if conn is not None and self._reusable(conn):
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

    def _keep_while_waiting(self, conn: ClientConn, waiting: bool) -> None:
        """``AsyncHolding.keep_while_waiting``: a request that may wait for its grant keeps
        its connection's session alive meanwhile."""
        holding = self.holding
        if holding is not None:
            holding.waiting = waiting
            if waiting:
                self._kept_by(conn, holding)

    def _kept_by(self, conn: ClientConn, holding: _Holding) -> None:
        """``AsyncHolding._kept_by``: ``holding`` keeps ``conn``'s session alive."""
        session = conn.session
        if session is not None:
            address = conn.address
            session.hold(holding, lambda: self._start_keeping(session, address))

    def _send_acquire(self, conn: ClientConn, core: LockCore) -> None:
        core.begin_acquire()
        detached = self.detached_holds and self.loop.chance(0.5) and self.info is not None
        if not detached and self.info is not None and self.loop.chance(0.3):
            self._enqueue(conn, core)
            return
        try:  # a lease above the server's longest is refused before it is sent
            if detached:
                command, data, timeout = core.hold_request(self.info, "sim", detached=True)
            else:
                command, data, timeout = core.acquire_request(self.info)
        except DflockError:
            self._finish("error")
            return
        sent = self.clock()
        self.loop.note(f"{self.name}: {data!r} on {conn.conn.id if conn.conn else '-'}")
        self._keep_while_waiting(conn, core.routing.acquire_timeout_s > 0)

        def answered(reply: Reply | None) -> None:
            if self.core is not core:
                return
            self._keep_while_waiting(conn, False)
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
            self._start_renewing(conn, core, detached=detached)

        conn.request(command, data, timeout, answered)

    def _enqueue(self, conn: ClientConn, core: LockCore) -> None:
        """Two-phase: ``e`` (join the queue), then ``w`` on the same connection."""
        try:
            command, data, timeout = core.enqueue_request(self.info)
        except DflockError:
            self._finish("error")
            return
        sent = self.clock()
        self.loop.note(f"{self.name}: {data!r} on {conn.conn.id if conn.conn else '-'}")
        self._keep_while_waiting(conn, True)

        def enqueued(reply: Reply | None) -> None:
            if self.core is not core:
                return
            self._keep_while_waiting(conn, False)
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
                self._start_renewing(conn, core)
            elif core.state is LockState.ENQUEUED:
                attempt.enqueued_t = self.loop.now
                self._wait(conn, core)
            else:
                self._finish("timeout")

        conn.request(command, data, timeout, enqueued)

    def _wait(self, conn: ClientConn, core: LockCore) -> None:
        command, data, timeout = core.wait_request(self.loop.rng.choice([0, 2, 10]))
        sent = self.clock()
        self._keep_while_waiting(conn, True)

        def answered(reply: Reply | None) -> None:
            if self.core is not core:
                return
            self._keep_while_waiting(conn, False)
            if reply is None:
                self._finish("error")
                return
            try:
                held = core.on_grant_reply(command, reply, sent, self.info, conn.session)
            except DflockError:
                self._finish("error")
                return
            if held:
                self._start_renewing(conn, core)
            else:
                self._finish("timeout")

        conn.request(command, data, timeout, answered)

    def _start_renewing(self, conn: ClientConn, core: LockCore, *, detached: bool = False) -> None:
        """``AsyncHolding.start_renewing``: the grant reached the client; one made on a
        connection whose session ended while it waited is confirmed first (`_confirm`)."""
        attempt = self.attempt
        assert attempt is not None and core.grant.token is not None
        attempt.granted_t = self.loop.now
        attempt.fence = _requests.fence_of(core.grant.token)
        self._prove(attempt, core)
        session = conn.session
        if detached or session is None or session.live():
            self._granted(conn, core, detached=detached)
        else:
            self._confirm(conn, core)

    def _prove(self, attempt: Attempt, core: LockCore) -> None:
        """How long the grant is proven held from the attempt's request: its lease, or in a
        client session while the session surely lives (its last join or keep-alive sent
        before the request, plus its time), and from each keep-alive answered."""
        attempt.lease = attempt.granted_lease = core.grant.lease
        session = core.grant.session
        if session is not None:
            requested = attempt.requested_t + self.proc.clock_offset
            attempt.lease = max(
                0.0, min(core.grant.lease, session.answered_at + session.ttl - requested)
            )
            attempt.session_ttl = min(core.grant.lease, session.ttl)

    def _confirm(self, conn: ClientConn, core: LockCore) -> None:
        """``AsyncHolding._confirm``: the connection joins the current session (``rejoin``:
        the server moves the grant into it, unless the one it was made in ran out and ended
        it) and the grant is renewed by token on it; not renewed, or a request that fails,
        and the grant is abandoned: the acquire returns False."""
        attempt = self.attempt
        assert attempt is not None
        attempt.confirming = True
        self.loop.note(f"{self.name}: its session ended while it waited: confirms {core.key}")

        def rejoined(joined: ClientConn | None, refused: bool) -> None:
            if self.core is not core:
                return
            if joined is None:
                self._abandon(core, "the rejoin failed")
                return
            core.grant.session = conn.session  # where the server has it now, if anywhere
            command, data, timeout = core.renew_request()
            sent = self.clock()

            def answered(reply: Reply | None) -> None:
                if self.core is not core:
                    return
                if reply is None:
                    self._abandon(core, "no answer to its renewal")
                    return
                outcome = core.on_renew_reply(reply, sent, conn.session)
                if not outcome.renewed:
                    self._abandon(core, outcome.lost_reason or "renewal refused")
                    return
                attempt.confirming = False
                self.loop.count("grant confirmed")
                self._granted(conn, core)

            conn.request(command, data, timeout, answered)

        self._join(conn, rejoined)

    def _abandon(self, core: LockCore, why: str) -> None:
        """The confirmation failed: the lock resets, nobody believed the grant (it ends with
        the session it is in)."""
        self.loop.note(f"{self.name}: {core.key} not confirmed: {why}")
        self.loop.count("grant not confirmed")
        if self.attempt is not None:
            self.attempt.told_t = self.loop.now
        core.reset()
        self._finish("lost")

    def _granted(self, conn: ClientConn, core: LockCore, *, detached: bool = False) -> None:
        """The acquire returns True: the lock is held, its renewal starts."""
        attempt = self.attempt
        assert attempt is not None
        self._prove(attempt, core)
        self.loop.note(f"{self.name}: granted {core.key} fence {attempt.fence}")
        if detached:  # a detached hold (``Client.hold``): no renewal, let go by token
            self.loop.note(f"{self.name}: detached hold of {core.key}")
            self.proc.later(
                self.loop.uniform(0.0, 0.7 * core.grant.lease), lambda: self._release(core)
            )
            return
        holding = self.holding
        assert holding is not None
        self._kept_by(conn, holding)
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
        attempt = self.attempt
        if core is None or core.state is not LockState.HELD or core.lost:
            return
        if attempt is not None and attempt.confirming:
            return  # (its renewal has not started)
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

    def _renew_on(self, conn: ClientConn, core: LockCore, *, reattach: bool = False) -> None:
        """A renewal by token on ``conn`` (``reattach``: a new connection, whose session the
        grant keeps alive once renewed: ``AsyncHolding._reattach_once``)."""
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
                attempt = self.attempt
                if attempt is not None:
                    at, lease = self.global_t(sent), core.grant.lease
                    if core.grant.session is None:
                        attempt.renewed_t.append(at)
                    attempt.proofs.append((at, lease))
                    if lease < attempt.granted_lease:
                        attempt.shortened(at, lease)
                self.conn = conn
                if reattach and self.holding is not None:
                    self.loop.count("reattached")
                    self._kept_by(conn, self.holding)
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
            self._renew_on(conn, core, reattach=True)

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
    def _start_keeping(self, session: ClientSession, address: str) -> object:
        self.proc.later(0.0, lambda: self._keep_tick(session, address))
        return session

    def _keep_tick(self, session: ClientSession, address: str) -> None:
        """One step of ``keepalive.keep_session_alive`` (the session with ``address``)."""
        if session.idle() or not session.live():
            if not session.idle():
                session.stopped()
            own = self.ka_conns.pop(session.id, None)
            if own is not None:
                own.close()  # its own: closed as it stops
            return
        now = self.clock()
        due = session.answered_at + session.interval()
        if now < due:
            self.proc.later(due - now, lambda: self._keep_tick(session, address))
            return
        conn = self.ka_conns.get(session.id)
        if conn is None or conn.gone:
            # A connection of its own, in the current session there (it keeps this one alive
            # by its id all the same), or in none: a restart without client sessions.

            def connected(conn: ClientConn | None, refused: bool) -> None:
                if conn is None:
                    if refused:
                        session.refused()
                    self.proc.later(0.25, lambda: self._keep_tick(session, address))
                    return
                if conn.session is None:  # its locks renew by themselves
                    conn.close()
                    session.stopped()
                    return
                self.ka_conns[session.id] = conn
                self._keep_tick(session, address)

            # As the keep-alive's: a connect takes no longer than the session has left.
            within = min(self.endpoint.connect_timeout_s, max(0.1, session.deadline() - now))
            self.dial(address, connected, within)
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
                    and not attempt.confirming
                ):
                    attempt.keepalive_t.append((self.global_t(sent), self.loop.now))
                    if attempt.cut is None or self.loop.now < attempt.proven_until():
                        # (past a cut, it proves only while the grant was still proven)
                        ttl = min(core.grant.lease, session.ttl)
                        attempt.proofs.append((self.global_t(sent), ttl))
            elif (
                isinstance(reply, _replies.ErrorReply)
                and reply.code == wire.STATUS_ERROR_UNAVAILABLE
            ):
                # A member that cannot tell yet whether it serves the session's keys: asked
                # again while the session runs, as the keep-alive's RETRY_PAUSE_S later.
                self.proc.later(0.25, lambda: self._keep_tick(session, address))
                return
            elif reply is not None:
                session.end("the server refused its keep-alive")
            self._keep_tick(session, address)

        conn.request(Command.PING, _requests.encode_keepalive(session.id), timeout, answered)


class _Holding:
    """A lock as its session sees it (``_session.Holder``; ``AsyncHolding.holds``)."""

    def __init__(self, client: SimClient, core: LockCore) -> None:
        self.client = client
        self.core = core
        self.waiting = False
        """An acquire that may wait is in flight."""

    def poke(self) -> None:
        self.client.proc.later(0.0, self.client._renew_tick)  # pyright: ignore[reportPrivateUsage]

    def holds(self) -> bool:
        core = self.core
        if self.client.core is not core:
            return False
        state = core.state
        return (state is LockState.HELD and not core.lost) or (
            state is LockState.ENQUEUED or self.waiting
        )
