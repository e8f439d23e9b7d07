"""The simulated lock server: the real table (``LockTable``), the real request handling
(``dispatch.Session``, one per connection) and the real fence counter, driven as
``dflockd_server.connection`` and ``stream`` drive them, on the simulated loop and network.

A cluster member's server has a ``ClusterNode`` and the real ``serving.KeyServing`` between
the two, as ``net.Server`` has: the node's ``NodeHost`` calls (its ownership snapshots,
``fail_waiters``, ``holders_in``, ``key_present``, ``renewals_allowed``), the ownership's checks,
the ``shards`` reply.

What is the simulator's own here is what ``connection.py`` and ``stream.py`` do with a socket:
the order of requests on a connection, a blocking acquire's timer, the read timeout (a close by
the server, which frees nothing early), a close by the peer, and the sweeps ``net.Server`` runs
(``expire`` each second, ``gc``). Each grant's reply is reported to the run (``on_grant``) at
the moment it leaves, the ground truth the run's invariants are checked against.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from dflockd_server import constants as c, protocol as p
from dflockd_server.cluster.fencestore import EtcdCeilingStore
from dflockd_server.cluster.shardmap import shard_id
from dflockd_server.dispatch import Close, RaiseBound, Session, Wait
from dflockd_server.fence import FenceStateError, StateUnwritable, fence_of
from dflockd_server.grace import LeaseRecord
from dflockd_server.journal import Journal, RecordedGrant
from dflockd_server.replay import (
    COMPLETE_SUFFIX,
    JournalRead,
    Restore,
    read_journal,
    restored_leases,
)
from dflockd_server.serving import KeyServing
from dflockd_server.shares import AddressShares
from dflockd_server.stream import refuse_replies
from dflockd_server.table import LockTable, Waiter
from dflockd_server.tokens import FenceCounter
from tests.sim.disk import Disk
from tests.sim.loop import Loop, Timer
from tests.sim.network import Conn
from tests.sim.process import Process

if TYPE_CHECKING:
    from dflockd_server.cluster.node import ClusterNode
    from dflockd_server.connection import Connection

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
    journal_fsync: str | None = None
    """``--journal-fsync`` of a server with a state directory (its lease journal); None: no
    state directory (``--fence-state-file`` only: a restart waits out the longest lease)."""


def _restored(read: JournalRead, wall_ms: int, **rules: Any) -> Restore:
    del wall_ms  # a mutation's (the product trusts no wall clock)
    return restored_leases(read, **rules)


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
    restored_leases: Callable[..., Restore] = _restored
    """What a start makes of the journal it read and the wall clock (``replay.restored_leases``,
    which trusts no wall clock)."""
    journal: type[Journal] = Journal
    ceiling_store: type[EtcdCeilingStore] = EtcdCeilingStore
    """A restarted cluster member's fence ceiling in etcd (``fencestore.EtcdCeilingStore``)."""
    fence_counter: type[FenceCounter] = FenceCounter
    """A restarted cluster member's fence counter."""
    asking_without_ticket: bool = False
    """A cluster member admits any ``asking`` for a key of a shard split to it, its ticket
    unchecked (and the ticket's counter not raised to)."""


class CeilingStore:
    """The fence ceiling file (``--fence-state-file``) on the simulated disk: written durably
    (``fence.FileCeilingStore.write`` fsyncs), so it outlives a crash and a reboot."""

    def __init__(self) -> None:
        self.ceiling = 0
        self.forget = False
        """The ``fence-from-wall-clock`` mutation: ``read`` finds nothing."""

    def read(self) -> int:
        return 0 if self.forget else self.ceiling

    def write(self, ceiling: int) -> None:
        self.ceiling = ceiling


@dataclass
class Machine:
    """The server's machine: what outlives its process (its disk, its clocks, its boot)."""

    wall_clock_ns: Callable[[], int]
    ceiling: CeilingStore = field(default_factory=CeilingStore)
    disk: Disk | None = None
    boot: str = "0"
    longest: int = 0
    """The longest lease granted (the ``grace`` record a start reads: ``leasebound``)."""
    grace_until: tuple[str, float] | None = None
    """(boot, monotonic s) at which a start's grace ends (the ``grace`` record's
    ``grace_until``: a start killed during its grace leaves the rest to the next on the same
    boot, ``grace.grace_left``)."""


class InOrder(set[object]):
    """``KeyServing.connections``: a set walked in the order its members were added (a set
    of objects is walked in the order of their addresses: a replay would not be exact)."""

    def __init__(self) -> None:
        super().__init__()
        self._order: dict[object, None] = {}

    def add(self, element: object) -> None:
        super().add(element)
        self._order[element] = None

    def discard(self, element: object) -> None:
        super().discard(element)
        self._order.pop(element, None)

    def __iter__(self) -> Iterator[object]:
        return iter(list(self._order))


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
        self.answer: Callable[[bytes], None] = lambda reply: None
        """Answer the wait in flight now (``Connection.answer_wait``)."""

    def answer_wait(self, reply: bytes) -> None:
        """``Connection.answer_wait``, as ``KeyServing.fail_waiters`` calls it."""
        self.answer(reply)


class SimServer:
    """One lock server process (see the module's doc)."""

    def __init__(
        self,
        loop: Loop,
        proc: Process,
        config: ServerConfig,
        mutations: Mutations,
        on_grant: Callable[[str, str, str], None],
        machine: Machine,
        *,
        serving: KeyServing | None = None,
        node: ClusterNode | None = None,
    ) -> None:
        self.loop = loop
        self.proc = proc
        self.config = config
        self.mutations = mutations
        self.on_grant = on_grant
        """Told of each grant as its reply leaves: (key, token, the client's address)."""
        self.machine = machine
        self.conns: dict[int, tuple[Conn, _ConnState]] = {}
        self.shares: AddressShares | None = None
        self.journal: Journal | None = None
        self._held: list[tuple[Conn, _ConnState, bytes, str]] = []
        """Replies held back until the journal is written (``stream.GroupWrite``)."""
        self._turn: Timer | None = None
        self.grace_s = 0.0
        self.node = node
        """A cluster member's node (None: a single server, serving every key)."""
        self._shards: tuple[object, bytes] = (None, b"")
        self.lease_record: LeaseRecord | None = None
        """A cluster member's longest lease bound (``grace.LeaseRecord``, published in etcd)."""
        self.serving = (
            serving if serving is not None else KeyServing(cast("set[Connection]", InOrder()))
        )
        self.table = self._start()
        self.serving.attach(self.table)  # a node handed it its snapshot already
        self._hello = p.reply_hello(
            c.SERVER_VERSION,
            durable=self.journal is not None,
            max_lease_ttl_s=config.max_lease,
            default_lease_ttl_s=config.default_lease,
            session_ttl_s=config.session_ttl,
            run=f"run{proc.life}",
        )
        self._sweeps()

    def _clocks(self) -> tuple[int, int, str]:
        """The journal's anchor: (wall ms, monotonic ms, boot id) of the simulated machine."""
        machine = self.machine
        return (
            machine.wall_clock_ns() // 1_000_000,
            int(self.proc.clock() * 1000),
            machine.boot,
        )

    def _start(self) -> LockTable:
        """What ``net.Server._start`` and ``state.plan_start`` make of the state: the leases
        the journal restores and the restart grace, then a new journal file holding them."""
        machine = self.machine
        disk = machine.disk
        leases: list[RecordedGrant] = []
        first = self.proc.life == 0
        grace = 0.0 if first else float(machine.longest)
        if disk is not None and os.path.exists(disk.journal):
            read = read_journal(disk.journal)
            wall_ms, mono_ms, boot = self._clocks()
            restore = self.mutations.restored_leases(
                read,
                wall_ms,
                complete=os.path.exists(disk.journal + COMPLETE_SUFFIX),
                run_longest=machine.longest,
                tail_lost="",
                monotonic_ms=mono_ms,
                this_boot=boot,
            )
            leases = restore.leases
            grace = restore.grace_s
            self.loop.count("restored" if leases else "restored none")
            if read.torn_tail:
                self.loop.count("torn tail read")
            if read.damaged_before_tail:
                grace = max(grace, float(machine.longest))
            self.loop.note(
                f"server: journal read: {len(leases)} lease(s) restored, grace {grace:.2f} s"
                + (f", damaged ({read.damage})" if read.damage else "")
            )
        until = machine.grace_until
        if until is not None and until[0] == machine.boot:
            grace = max(grace, until[1] - self.proc.clock())
        if grace > 0:
            machine.grace_until = (machine.boot, self.proc.clock() + grace)
        self.grace_s = grace
        table = self._new_table()
        if disk is not None:
            _, highest, _ = table.restore_all(leases)
            if highest:
                self.counter.raise_to(highest)
            journal = self.mutations.journal(
                disk.journal,
                self.config.journal_fsync or "always",
                table.clock,
                fsync_file=disk.fsync_file,
                fsync_dir=disk.fsync_dir,
                write=disk.write,
                clocks=self._clocks,
            )
            journal.anchor()
            journal.open(self._live_records(journal, table))
            table.grants.journal = self.journal = journal
        return table

    @staticmethod
    def _live_records(journal: Journal, table: LockTable) -> list[bytes]:
        """``net.Server._live_records``."""
        return [
            journal.grant_record(holder, state, holder.client is table.grants.detached, on_close)
            for holder, state, on_close in table.live_holders()
        ]

    def _new_table(self) -> LockTable:
        cfg = self.config
        self.machine.ceiling.forget = self.mutations.fence_from_wall_clock
        if self.node is not None:
            counter = self.counter = self.node.fence
        else:
            counter = self.counter = FenceCounter(
                store=self.machine.ceiling,
                wall_clock_ns=self.machine.wall_clock_ns,
                random_bytes=self.loop.rng.randbytes,
                persist_block=64,
            )
        node = self.node
        record = self.lease_record = None
        if node is not None:
            # ``net.Server._start``: the start's bound recorded (published in etcd) before it
            # serves; each longer one before the request that needs it is answered.
            record = self.lease_record = LeaseRecord(
                None, self.grace_s, cfg.max_lease, publish=node.publish_longest
            )
        table = self.mutations.table(
            clock=self.proc.clock,
            new_token=counter.next_token,
            max_locks=cfg.max_locks,
            session_ttl_s=cfg.session_ttl,
            grace_s=self.grace_s,
            note_lease=None if record is None else record.note,
            lease_noted=0 if record is None else record.longest,
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
        return self.serving.key_check

    def asked_check(self, key: str) -> bytes | None:
        return self.serving.asked_check(key)

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        node = self.node
        if self.mutations.asking_without_ticket and node is not None:
            own = node.ownership
            if own.alive() and shard_id(key) in own.importing:
                return None
        return self.serving.admit_ask(key, ticket)

    def may_hold(self, key: str) -> bool:
        return self.serving.may_hold(key)

    @property
    def hold_check(self) -> Callable[[str], bool] | None:
        return self.serving.hold_check

    def shards_reply(self) -> bytes:
        """``KeyServing.shards_reply``, once per snapshot of the node (immutable: the same
        reply; the run's time would go to describing 8192 shards again and again)."""
        node = self.node
        if node is None:
            return p.REPLY_ERROR
        own = node.ownership
        if self._shards[0] is not own:
            self._shards = (own, self.serving.shards_reply())
        return self._shards[1]

    def over_ip_share(self, session: Session) -> bool:
        """``admission.Admission.over_ip_share``, without its log line."""
        shares = self.shares
        return shares is not None and shares.load(session.ip) >= session.locks_per_ip

    # ------------------------------------------------------------------ maintenance
    def _sweeps(self) -> None:
        def sweep() -> None:
            if self.table.expire():
                self.loop.note(f"{self.proc.name}: leases expired")
            journal = self.journal
            if journal is not None:
                self._journal_upkeep(journal)
            self.proc.later(self.config.sweep_s, sweep)

        def gc() -> None:
            self.table.gc(60.0)
            self.proc.later(5.0, gc)

        self.proc.later(self.config.sweep_s, sweep)
        self.proc.later(5.0, gc)

    def _journal_upkeep(self, journal: Journal) -> None:
        """``net.Server._journal_upkeep``: write what no reply has, recover a journal that
        could not be written, compact (here at random sweeps: the server does past 4 MiB), and
        the everysec fsync (here on the loop: no thread in a simulation)."""
        table = self.table
        self._settle(journal, self._held)
        if not journal.writable:
            if journal.recover(self._live_records(journal, table)):
                self.loop.note(f"{self.proc.name}: the journal can be written again")
                self.loop.count("journal recovered")
                table.grants.fill_waiting()
            return
        if self.loop.chance(0.03):
            journal.compact(self._live_records(journal, table))
            self._settle(journal, self._held)
            self.loop.note(
                f"{self.proc.name}: compaction {'done' if journal.writable else 'failed'}"
            )
            self.loop.count("compaction" if journal.writable else "compaction failed")
        if journal.fsync == "everysec" and journal.dirty:
            # (a failure is kept for the next flush, as the thread's is)
            with contextlib.suppress(OSError):
                journal.sync()

    def _settle(
        self, journal: Journal, held: list[tuple[Conn, _ConnState, bytes, str]]
    ) -> list[bytes]:
        """Write the journal; the grants it could not hold are undone (nobody was told of
        them) and their held-back replies refused (``GroupWrite._refuse``)."""
        journal.flush()
        if not journal.refused:
            return []
        refused = journal.take_refused()
        for key, token in refused:
            self.table.release(key, token)
        journal.flush()
        tokens = [token.encode() for _, token in refused]
        self.loop.note(
            f"{self.proc.name}: {len(tokens)} grant(s) the journal could not hold, undone"
        )
        self.loop.count("grant undone")
        for i, (conn, state, reply, key) in enumerate(held):
            held[i] = (conn, state, refuse_replies(reply, tokens), key)
        return tokens

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
        state.answer = lambda reply: self._answer_wait(conn, state, reply)
        self.conns[conn.id] = (conn, state)
        self._connections.add(state)
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
        self._connections.discard(state)
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
        self.loop.note(
            f"{self.proc.name}: connection {conn.id} closed ({'peer' if by_peer else 'server'})"
        )

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
        self.loop.note(f"{self.proc.name}: read timeout on connection {conn.id}")
        self.loop.count("read timeout")
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
            shown = reply if reply is None or len(reply) < 120 else reply[:100] + b"..."
            self.loop.note(f"{self.proc.name}: {conn.id} {b' '.join(frame)!r} -> {shown!r}")
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
        if isinstance(action, RaiseBound):
            state.busy = True
            delay = self.loop.uniform(0.001, 0.02)  # (the recording thread's etcd round trip)
            self.proc.later(delay, lambda: self._record_bound(conn, state, action))
            return None
        raise AssertionError(f"the simulated server does not do {action!r}")

    def _record_bound(self, conn: Conn, state: _ConnState, parked: RaiseBound) -> None:
        """``leasebound.LeaseBound``'s recording (``LeaseRecord.note``: a cluster member
        publishes the longer bound in etcd), then ``Connection._bound_recorded``: the parked
        request answered as if it had just arrived, or refused when the bound could not be
        recorded."""
        record = self.lease_record
        if conn.id not in self.conns or record is None:
            return
        try:
            record.note(parked.lease)
        except FenceStateError as exc:
            self.loop.note(f"{self.proc.name}: the longer lease bound could not be published")
            self.loop.count("lease bound refused")
            unwritable = isinstance(exc, StateUnwritable)
            refusal = p.REPLY_ERROR_READ_ONLY if unwritable else p.REPLY_ERROR_UNAVAILABLE
            self._done_waiting(conn, state, refusal, parked.frame[1].decode())
            return
        self.loop.count("lease bound published")
        self.table.grants.lease_noted = record.longest
        session = state.session
        session.asking = parked.asking
        state.frame_key = parked.frame[1].decode()
        reply = session.handle(parked.frame)
        if reply is None:
            reply = self._act(conn, state)
            if reply is None:
                return
        self._done_waiting(conn, state, reply, state.frame_key)

    def _granted(self, conn: Conn, state: _ConnState, waiter: Waiter) -> None:
        reply = state.session.granted(waiter)
        key = waiter.state.key
        self._done_waiting(conn, state, reply, key)

    @property
    def _connections(self) -> set[_ConnState]:
        """The connections ``KeyServing`` walks (``fail_waiters``): each one's state stands in
        for its ``Connection`` (``waiter``, ``session``, ``answer_wait``)."""
        return cast("set[_ConnState]", self.serving.connections)

    def _answer_wait(self, conn: Conn, state: _ConnState, reply: bytes) -> None:
        """``Connection.answer_wait``: the wait in flight answered ``reply`` (its shard moved)."""
        waiter = state.waiter
        if waiter is not None and conn.id in self.conns:
            state.session.give_up(waiter)
            self._done_waiting(conn, state, reply, waiter.state.key)

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
        """A reply leaves, after the journal holds what it answers (``stream.GroupWrite``: the
        journal written once for the turn, then the replies held back)."""
        if self.journal is None:
            self._emit(conn, state, reply, key)
            return
        self._held.append((conn, state, reply, key))
        if self._turn is None:
            self._turn = self.proc.later(0.0, self._write_turn)

    def _write_turn(self) -> None:
        self._turn = None
        held, self._held = self._held, []
        journal = self.journal
        if journal is not None:
            self._settle(journal, held)
        for conn, state, reply, key in held:
            if conn.id in self.conns:
                self._emit(conn, state, reply, key)
            else:  # gone before its reply left: a grant nobody was told of ends
                token = self._granted_token(reply)  # (``Connection._free_untold``)
                if token is not None:
                    self.table.release(key, token)

    @staticmethod
    def _granted_token(reply: bytes) -> str | None:
        if reply.startswith((b"ok ", b"acquired ")):
            parts = reply.split()
            if len(parts) == 3 and len(parts[1]) == c.TOKEN_HEX_CHARS:
                return parts[1].decode()
        return None

    def _emit(self, conn: Conn, state: _ConnState, reply: bytes, key: str) -> None:
        token = self._granted_token(reply)
        if token is not None:
            lease = int(reply.split()[2])
            self.machine.longest = max(self.machine.longest, lease)
            self.loop.note(f"{self.proc.name}: grant {key} fence {fence_of(token)} to {conn.id}")
            self.on_grant(key, token, state.ip)
        conn.to_client(reply)

    # ------------------------------------------------------------------ process faults
    def crash(self) -> None:
        """The process dies: its kernel resets every connection and closes its files (the
        journal's, with nothing more written to it)."""
        for conn, _ in list(self.conns.values()):
            conn.close_by_server(reset=True)
        self.conns.clear()
        journal = self.journal
        if journal is not None:
            fd = journal._fd  # pyright: ignore[reportPrivateUsage] - a kill: no close record
            if fd >= 0:
                os.close(fd)
