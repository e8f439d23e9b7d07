"""The simulated lock server: the real table (``LockTable``), the real request handling
(``dispatch.Session``, one per connection) and the real fence counter, driven as
``dflockd_server.connection`` and ``stream`` drive them, on the simulated loop and network.

What is the simulator's own here is what ``connection.py`` and ``stream.py`` do with a socket:
the order of requests on a connection, a blocking acquire's timer, the read timeout (a close by
the server, which frees nothing early), a close by the peer, and the sweeps ``net.Server`` runs
(``expire`` each second, ``gc``). Each grant's reply is reported to the run (``on_grant``) at
the moment it leaves, the ground truth the run's invariants are checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dflockd_server import constants as c, protocol as p
from dflockd_server.dispatch import Close, Session, Wait
from dflockd_server.fence import fence_of
from dflockd_server.shares import AddressShares
from dflockd_server.table import LockTable, Waiter
from dflockd_server.tokens import FenceCounter
from tests.sim.loop import Loop, Timer
from tests.sim.network import Conn
from tests.sim.process import Process

__all__ = ["ServerConfig", "SimServer"]


@dataclass
class ServerConfig:
    """The server's settings in a run (its flags)."""

    default_lease: int = 12
    max_lease: int = 60
    read_timeout: float = 23.0
    session_ttl: int = c.DEFAULT_SESSION_TTL_S
    locks_per_ip: int = 0
    max_locks: int = 1024
    sweep_s: float = 1.0


@dataclass
class Mutations:
    """The test-only switches of a run's server (``mutations``), as the simulator's own
    subclasses: the product code has none of them."""

    table: type[LockTable] = LockTable
    shares: type[AddressShares] = AddressShares
    read_timeout_by_peer: bool = False
    """A read timeout's close counts as the peer's: it frees the connection's grants."""
    fence_from_wall_clock: bool = False
    """A start reads no stored fence ceiling: its counter starts at the wall clock."""


class CeilingStore:
    """The fence ceiling file (``--fence-state-file``) on the simulated disk: written durably
    (``fence.write_ceiling`` fsyncs), so it outlives a crash and a reboot."""

    def __init__(self) -> None:
        self.ceiling = 0
        self.forget = False
        """The ``fence-from-wall-clock`` mutation: ``read`` finds nothing."""

    def read(self) -> int:
        return 0 if self.forget else self.ceiling

    def write(self, ceiling: int) -> None:
        self.ceiling = ceiling


class _ConnState:
    """What ``connection.Connection`` and ``stream.Stream`` keep for one connection."""

    def __init__(self, session: Session, ip: str) -> None:
        self.session = session
        self.ip = ip
        self.framer = p.RequestFramer()
        self.busy = False
        self.waiter: Waiter | None = None
        self.wait_timer: Timer | None = None
        self.last_rx = 0.0
        self.read_timer: Timer | None = None
        self.frame_key = ""


class SimServer:
    """One lock server process (see the module's doc)."""

    def __init__(
        self,
        loop: Loop,
        proc: Process,
        config: ServerConfig,
        mutations: Mutations,
        on_grant: Callable[[str, str, str], None],
        wall_clock_ns: Callable[[], int],
        ceiling: CeilingStore,
        grace_s: float = 0.0,
    ) -> None:
        self.loop = loop
        self.proc = proc
        self.config = config
        self.mutations = mutations
        self.on_grant = on_grant
        """Told of each grant as its reply leaves: (key, token, the client's address)."""
        self.wall_clock_ns = wall_clock_ns
        self.ceiling = ceiling
        self.grace_s = grace_s
        self.longest_lease = 0
        """The longest lease granted (the ``grace`` record a restart reads)."""
        self.conns: dict[int, tuple[Conn, _ConnState]] = {}
        self.shares: AddressShares | None = None
        self.table = self._new_table()
        self._hello = p.reply_hello(
            c.SERVER_VERSION,
            max_lease_ttl_s=config.max_lease,
            default_lease_ttl_s=config.default_lease,
            session_ttl_s=config.session_ttl,
            run=f"run{proc.life}",
        )
        self._sweeps()

    def _new_table(self) -> LockTable:
        cfg = self.config
        self.ceiling.forget = self.mutations.fence_from_wall_clock
        counter = FenceCounter(
            store=self.ceiling,
            wall_clock_ns=self.wall_clock_ns,
            random_bytes=self.loop.rng.randbytes,
            persist_block=64,
        )
        table = self.mutations.table(
            clock=self.proc.clock,
            new_token=counter.next_token,
            max_locks=cfg.max_locks,
            session_ttl_s=cfg.session_ttl,
            grace_s=self.grace_s,
        )
        if cfg.locks_per_ip:
            self.shares = table.grants.shares = self.mutations.shares(cfg.locks_per_ip)
        return table

    # ------------------------------------------------------------------ dispatch.Host
    @property
    def draining(self) -> bool:
        return False

    @property
    def secret(self) -> bytes | None:
        return None

    @property
    def hello_reply(self) -> bytes:
        return self._hello

    @property
    def key_check(self) -> Callable[[str], bytes | None] | None:
        return None

    def asked_check(self, key: str) -> bytes | None:
        return None

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        return None

    def may_hold(self, key: str) -> bool:
        return True

    def shards_reply(self) -> bytes:
        return p.REPLY_ERROR

    def over_ip_share(self, session: Session) -> bool:
        """``admission.Admission.over_ip_share``, without its log line."""
        shares = self.shares
        return shares is not None and shares.load(session.ip) >= session.locks_per_ip

    # ------------------------------------------------------------------ maintenance
    def _sweeps(self) -> None:
        def sweep() -> None:
            if self.table.expire():
                self.loop.note("server: leases expired")
            self.proc.later(self.config.sweep_s, sweep)

        def gc() -> None:
            self.table.gc(60.0)
            self.proc.later(5.0, gc)

        self.proc.later(self.config.sweep_s, sweep)
        self.proc.later(5.0, gc)

    # ------------------------------------------------------------------ connections
    def accept(self, conn: Conn, ip: str) -> None:
        """A new connection from ``ip`` (``Connection.connection_made``)."""
        cfg = self.config
        session = Session(self, self.table, cfg.default_lease, cfg.max_lease, f"{ip}#{conn.id}")
        session.ip, session.locks_per_ip = ip, cfg.locks_per_ip or c.NO_CAP
        if self.shares is not None:
            self.shares.opened(session.client, ip)
        state = _ConnState(session, ip)
        state.last_rx = self.proc.clock()
        self.conns[conn.id] = (conn, state)
        conn.server_side = self
        self._arm_read_timer(conn, state, cfg.read_timeout)

    def received(self, conn: Conn, data: bytes) -> None:
        found = self.conns.get(conn.id)
        if found is None:
            return
        state = found[1]
        state.last_rx = self.proc.clock()
        state.framer.feed(data)
        if not state.busy:
            self._process(conn, state)

    def closed(self, conn: Conn, *, reset: bool) -> None:
        """The peer closed or reset the connection (``connection_lost``, by the peer)."""
        self._lost(conn, by_peer=True)

    def _lost(self, conn: Conn, *, by_peer: bool) -> None:
        found = self.conns.pop(conn.id, None)
        if found is None:
            return
        state = found[1]
        for timer in (state.wait_timer, state.read_timer):
            if timer is not None:
                timer.cancel()
        if state.waiter is not None:
            state.waiter.wake = None
            state.waiter = None
        session = state.session
        session.close(by_peer=by_peer)
        if self.shares is not None:
            self.shares.closed(session.client, state.ip)
        self.loop.note(f"server: connection {conn.id} closed ({'peer' if by_peer else 'server'})")

    def close_by_server(self, conn: Conn) -> None:
        """This server closes the connection on its own (a read timeout): frees nothing early."""
        conn.close_by_server()
        self._lost(conn, by_peer=self.mutations.read_timeout_by_peer)

    def _arm_read_timer(self, conn: Conn, state: _ConnState, delay: float) -> None:
        state.read_timer = self.proc.later(delay, lambda: self._read_timer_fired(conn, state))

    def _read_timer_fired(self, conn: Conn, state: _ConnState) -> None:
        """``stream.Stream._read_timer_fired``."""
        state.read_timer = None
        if conn.id not in self.conns:
            return
        timeout = self.config.read_timeout
        idle = self.proc.clock() - state.last_rx
        kept = state.session.client.kept_by is not None
        if state.busy or idle < timeout or kept:
            delay = timeout if state.busy or idle >= timeout else timeout - idle
            # (at least a millisecond: a virtual clock does not move on by itself, and the
            # rounding of a clock far from 0 can leave ``idle`` a hair short of ``timeout``)
            self._arm_read_timer(conn, state, max(delay, 0.001))
            return
        self.loop.note(f"server: read timeout on connection {conn.id}")
        self.close_by_server(conn)

    # ------------------------------------------------------------------ requests
    def _process(self, conn: Conn, state: _ConnState) -> None:
        """``Connection._process``: answer in order until one blocks."""
        session = state.session
        while not state.busy and conn.id in self.conns:
            frame = state.framer.next_frame()
            if frame is None:
                break
            state.frame_key = frame[1].decode()
            reply = session.handle(frame)
            self.loop.note(f"server: {conn.id} {b' '.join(frame)!r} -> {reply!r}")
            if reply is None:
                reply = self._act(conn, state)
                if reply is None:
                    continue
            self._send(conn, state, reply, state.frame_key)

    def _act(self, conn: Conn, state: _ConnState) -> bytes | None:
        session = state.session
        action = session.action
        session.action = None
        if isinstance(action, Wait):
            waiter = state.waiter = action.waiter
            waiter.wake = lambda w: self._granted(conn, state, w)
            state.busy = True
            state.wait_timer = self.proc.later(
                action.timeout, lambda: self._wait_timed_out(conn, state)
            )
            return None
        if isinstance(action, Close):
            self._send(conn, state, action.reply, "")
            self.close_by_server(conn)
            return None
        raise AssertionError(f"the simulated server does not do {action!r}")

    def _granted(self, conn: Conn, state: _ConnState, waiter: Waiter) -> None:
        reply = state.session.granted(waiter)
        key = waiter.state.key
        self._done_waiting(conn, state, reply, key)

    def _wait_timed_out(self, conn: Conn, state: _ConnState) -> None:
        state.wait_timer = None
        waiter = state.waiter
        if waiter is None or conn.id not in self.conns:
            return
        reply = state.session.timed_out(waiter)
        state.session.give_up(waiter)
        self._done_waiting(conn, state, reply, waiter.state.key)

    def _done_waiting(self, conn: Conn, state: _ConnState, reply: bytes, key: str) -> None:
        state.waiter = None
        if state.wait_timer is not None:
            state.wait_timer.cancel()
            state.wait_timer = None
        state.busy = False
        state.last_rx = self.proc.clock()
        self._send(conn, state, reply, key)
        # the rest of what it sent, on a later pass (call_soon)
        self.proc.later(0.0, lambda: self._process(conn, state) if not state.busy else None)

    def _send(self, conn: Conn, state: _ConnState, reply: bytes, key: str) -> None:
        if reply.startswith((b"ok ", b"acquired ")):
            parts = reply.split()
            if len(parts) == 3 and len(parts[1]) == c.TOKEN_HEX_CHARS:
                token = parts[1].decode()
                self.loop.note(f"server: grant {key} fence {fence_of(token)} to {conn.id}")
                self.longest_lease = max(self.longest_lease, int(parts[2]))
                self.on_grant(key, token, state.ip)
        conn.to_client(reply)

    # ------------------------------------------------------------------ process faults
    def crash(self) -> None:
        """The process dies: its kernel resets every connection."""
        for conn, _ in list(self.conns.values()):
            conn.close_by_server(reset=True)
        self.conns.clear()
