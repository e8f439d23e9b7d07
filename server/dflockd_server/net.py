"""The asyncio server: ``Server`` (start, listener, maintenance timers, shutdown). It has an
``admission.Admission`` (which connections it takes, and their counts) and a
``serving.KeyServing`` (which keys it serves; its cluster node's ``NodeHost``), which its
connections and sessions call through it. Each accepted connection is a
``connection.Connection`` over a ``stream.Stream``, whose requests go through
``dispatch.Session`` to the ``table.LockTable``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dflockd_server import conditions, constants as c, protocol as p
from dflockd_server.admission import Admission
from dflockd_server.buildinfo import BUILD
from dflockd_server.certificate import ServedCertificate
from dflockd_server.cluster.asktickets import TICKET_LIFE_S
from dflockd_server.conditions import Condition
from dflockd_server.config import Config, ConfigError
from dflockd_server.connection import Connection
from dflockd_server.fence import FenceStateError, FileCeilingStore
from dflockd_server.grace import LeaseRecord
from dflockd_server.journal import Journal, paused_gc
from dflockd_server.leasebound import LeaseBound
from dflockd_server.loops import loop_name
from dflockd_server.metrics import MetricsExporter, RequestTimes, Snapshot
from dflockd_server.ownership import Ownership
from dflockd_server.serving import KeyServing, make_cluster_node, make_ownership
from dflockd_server.settings import names
from dflockd_server.snapshots import RationedSnapshots
from dflockd_server.state import StartPlan, StateDir, plan_start, resolve_state_dir
from dflockd_server.status_page import StatusPage
from dflockd_server.stream import GroupWrite, Stream
from dflockd_server.table import LockTable
from dflockd_server.tokens import FenceCounter

if TYPE_CHECKING:
    from dflockd_server.cluster.node import ClusterNode

__all__ = ["Server", "make_cluster_node", "make_ownership"]  # the makers: from serving

log = logging.getLogger("dflockd_server")


_JITTER_MIN, _JITTER_MAX = 0.5, 1.5  # of a fragment delay


class Server:
    """A dflockd-compatible lock server: ``await start()``, ``port``, ``await stop()``."""

    def __init__(self, config: Config | None = None, *, ownership: Ownership | None = None) -> None:
        self.config = config or Config()
        self._given_ownership = ownership  # testing: serve by it, not by the config's
        self.draining = False
        self.admission = admission = Admission(self.config, lambda: self.draining)
        """Which connections it takes (``admit``, ``forget``, the TLS handshakes' slots)."""
        self.serving = serving = KeyServing(admission.connections)
        """Which keys it serves (``set_ownership``), and its cluster node's host."""
        self.key_check: Callable[[str], bytes | None] | None = None
        # What its sessions (``dispatch.Host``), connections (``connection.ServerSide``) and
        # cluster node (``NodeHost``) call, bound to the part that answers it; `set_ownership`
        # keeps the checks read per acquire or keep-alive (key_check to admit_ask) current.
        self.may_hold = serving.may_hold
        self.hold_check = serving.hold_check
        self.asked_check = serving.asked_check
        self.admit_ask = serving.admit_ask
        self.shards_reply = serving.shards_reply
        self.over_ip_share = admission.over_ip_share
        self.admit = admission.admit
        self.forget = admission.forget
        self.transport_lost = admission.transport_lost
        self.handshake_started = admission.handshake_started
        self.handshake_ended = admission.handshake_ended
        self.fail_waiters = serving.fail_waiters
        self.holders_in = serving.holders_in
        self.key_present = serving.key_present
        self.renewals_allowed = serving.renewals_allowed
        self.node: ClusterNode | None = None  # a cluster member's node (--cluster)
        self.secret: bytes | None = None
        self._stopped: asyncio.Event | None = None
        self._stopping = False
        self._drain_cut = False  # `cut_drain`: the drain ends now
        self._listener: asyncio.Server | None = None
        self.ssl_context: ssl.SSLContext | None = None  # on TLS: what each TlsSession is made from
        self.certificate: ServedCertificate | None = None  # on TLS: the files, watched
        self.snapshots: RationedSnapshots | None = None  # answers stats (rationed)
        self._timers: list[asyncio.TimerHandle] = []
        self._stalled_said = 0  # keys stalled (no token for their next waiter) the log last said
        self._loop: asyncio.AbstractEventLoop | None = None
        self.clock: Callable[[], float] = time.monotonic
        """The loop's clock: the lock table's and the connections' time."""
        self._table: LockTable | None = None
        self.fence: FenceCounter | None = None
        self.lease_bound: LeaseBound | None = None
        """Raises the recorded longest lease off the loop (parked requests wait for it)."""
        self._fence_ahead: concurrent.futures.ThreadPoolExecutor | None = None
        self.state: StateDir | None = None  # --state-dir, locked while this server runs
        self.journal: Journal | None = None  # the lease journal (with a state directory)
        self.grace_reason = ""  # why this start has a restart grace
        self.run = secrets.token_hex(8)
        """This start of the server, in ``hello`` (``run``): sessions do not outlive it."""
        self._hello = self._make_hello()
        self._group_write: GroupWrite | None = None
        self.request_times: RequestTimes | None = None  # per-command timing, with metrics_port
        self.metrics: MetricsExporter | None = None  # and its HTTP exporter
        self._jitter = random.Random()
        cap = c.FRAGMENT_READ_DELAY_MAX_S
        if self.config.read_timeout_s > 0:
            cap = min(cap, self.config.read_timeout_s / 4)
        self._fragment_delay_cap = cap
        self.longest_fragment_delay = _JITTER_MAX * cap

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

    async def start(self) -> None:
        """Bind and start serving; returns once the listening socket is open. A cluster member
        that joined but cannot serve (its port taken, its metrics port too) leaves the cluster
        at once, instead of holding shards until its etcd lease runs out."""
        try:
            await self._start()
        except BaseException:
            if self._listener is not None:
                self._listener.close()
            for timer in self._timers:
                timer.cancel()
            node, self.node = self.node, None
            if node is not None:
                await asyncio.get_running_loop().run_in_executor(None, node.stop)
            self._close_state()
            raise

    def _close_state(self) -> None:
        """Close the journal and unlock the state directory (at the stop, or a failed start)."""
        if self.lease_bound is not None:
            self.lease_bound.close()
        if self._fence_ahead is not None:
            self._fence_ahead.shutdown(wait=False)
        journal, self.journal = self.journal, None
        if self._group_write is not None:
            self._group_write.journal = None
        if self._table is not None:
            # what comes after (connections closed) is not recorded
            self._table.grants.journal = None
        try:
            if journal is not None:
                try:
                    journal.close()
                except OSError as exc:
                    log.error("journal: cannot write %s at the stop: %s", journal.path, exc)
        finally:
            state, self.state = self.state, None
            if state is not None:
                state.close()

    @property
    def hello_reply(self) -> bytes:
        """The ``hello`` reply: what this server is and supports (and, during a restart
        grace, how long it still runs)."""
        table = self._table
        if table is not None and table.grants.in_grace:
            remaining = table.grace_remaining()
            if remaining > 0:
                return self._make_hello(durable=self.journal is not None, grace_s=remaining)
        return self._hello

    def _make_hello(self, *, durable: bool = False, grace_s: float = 0.0) -> bytes:
        """The ``hello`` reply: with the build and, once started, the loop (``buildinfo``)."""
        return p.reply_hello(
            c.SERVER_VERSION,
            durable=durable,
            grace_s=grace_s,
            max_lease_ttl_s=self.config.max_lease_ttl_s,
            default_lease_ttl_s=self.config.default_lease_ttl_s,
            session_ttl_s=self.config.session_ttl_s,
            build=BUILD,
            loop=loop_name(self._loop) if self._loop is not None else "",
            run=self.run,
        )

    async def _start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._hello = self._make_hello()  # now with the loop
        self._group_write = GroupWrite(loop.call_soon)
        # ``time.monotonic`` itself where ``loop.time`` returns only that (asyncio's own loops):
        # the same times, without a Python call around each one.
        self.clock = time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else loop.time
        self.serving.loop, self.serving.loop_thread = loop, threading.get_ident()
        token = cfg.resolve_auth_token()
        self.secret = token.encode() if token is not None else None
        if cfg.tls_cert and cfg.tls_key:
            self.certificate = ServedCertificate(cfg.tls_cert, cfg.tls_key)
            self.ssl_context = self.certificate.context
        if (state_path := resolve_state_dir(cfg)) is not None:
            default = cfg.state_dir is None  # the address's own: another server is on it
            state = StateDir(state_path, address=f"{cfg.host}:{cfg.port}" if default else None)
            state.open()
            self.state = state
        plan = plan_start(cfg, self.state)
        grace = plan.grace
        if cfg.cluster is not None:
            # Joins etcd (blocking I/O, off the loop); its fencing counter publishes its ceiling
            # in etcd, so a key's next member starts above every fence granted here. (Imported
            # here, as make_cluster_node imports the cluster's modules.)
            from dflockd_server.cluster.etcd import DuplicateMember, EtcdAuthError, EtcdError

            node = make_cluster_node(cfg, self)  # it hands this server its snapshots
            try:
                await loop.run_in_executor(None, node.start)
            except DuplicateMember as exc:
                raise ConfigError(f"{names('cluster')} {cfg.cluster}: {exc}") from exc
            except (EtcdError, FenceStateError) as exc:
                refused = exc if isinstance(exc, EtcdAuthError) else exc.__cause__
                if isinstance(refused, EtcdAuthError):
                    user = cfg.cluster_user
                    raise ConfigError(
                        f"{names('cluster')} {cfg.cluster}: etcd refused "
                        + (f"the user {user!r}" if user else "a request without a user")
                        + f" ({refused}); check {names('cluster_user')} and "
                        + names("cluster_password_file")
                    ) from exc
                hint = "check that etcd runs there and that the URL is right"
                if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                    hint = (
                        "etcd's certificate is not trusted: give the CA that signs it with "
                        + names("cluster_ca_file")
                    )
                elif "WRONG_VERSION_NUMBER" in str(exc) or "RemoteDisconnected" in str(exc):
                    hint += " (etcds:// speaks TLS to etcd, etcd:// plain HTTP: which does it?)"
                raise ConfigError(
                    f"{names('cluster')} {cfg.cluster}: cannot join the cluster ({exc}); {hint}"
                ) from exc
            self.node = node
            self.fence = fence = node.fence
        else:
            store = None if plan.fence_file is None else FileCeilingStore(plan.fence_file)
            # On a full disk the first ceiling is stored before the first token instead.
            self.fence = fence = await loop.run_in_executor(
                None, lambda: FenceCounter(store=store, defer_failed_store=True)
            )
        # Each next ceiling is stored ahead of the counter on a thread of its own (tokens),
        # started now, not at the first store: a server that can start no more threads by then
        # (a container at its pid limit) would grant nothing past the ceiling.
        self._fence_ahead = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dflockd-fence-ceiling"
        )
        await loop.run_in_executor(self._fence_ahead, lambda: None)
        fence.store_ahead(self._fence_ahead)
        # Recorded (and a cluster member's published) before serving, on a thread of its own
        # (an fsync, an etcd round trip: leasebound): a start killed during its grace leaves
        # the same bound, and the leases it restores are covered.
        publish = self.node.publish_longest if self.node is not None else None
        self.lease_bound = bound = await LeaseBound.start(
            loop,
            lambda: LeaseRecord(
                plan.grace_record,
                max(grace.seconds, plan.longest_restored),
                cfg.max_lease_ttl_s,
                publish=publish,
                grace_s=grace.seconds,
            ),
        )
        self._table = table = LockTable(
            clock=self.clock,
            new_token=fence.next_token,
            max_locks=cfg.max_locks,
            max_waiters=cfg.max_waiters,
            max_locks_per_connection=cfg.max_locks_per_connection,
            max_waits_per_connection=cfg.max_waits_per_connection,
            auto_release_on_disconnect=cfg.auto_release_on_disconnect,
            session_ttl_s=cfg.session_ttl_s,
            grace_s=grace.seconds,
            note_lease=bound.note_now,
            lease_noted=bound.record.longest,
        )
        bound.table = table
        self.serving.attach(table)
        self.admission.share_table(table)
        if plan.journal is not None:
            highest = self._restore(plan, table)
            if highest:  # a member's ceiling is in etcd: stored off the loop
                await loop.run_in_executor(None, fence.raise_to, highest)
        self.grace_reason = grace.why if grace.seconds > 0 else ""
        if grace.seconds > 0:
            log.warning(
                "restart grace: granting no key for %g s, until every lease the previous "
                "server may have granted has ended (%s); acquires wait or time out meanwhile",
                grace.seconds,
                grace.why,
            )
        else:
            log.info("restart grace: none (%s)", grace.why)
        self.snapshots = snapshots = RationedSnapshots(loop, lambda: p.reply_json(self.stats()))
        if (given := self._given_ownership) is not None:
            self.set_ownership(given)
        elif self.node is None:
            self.set_ownership(make_ownership(cfg))
        self._stopped = asyncio.Event()
        # TLS or not, the loop sees plain TCP: a TLS connection's session is its own (tls.py).
        self._listener = await loop.create_server(
            lambda: Connection(self, self, Stream(self)),
            cfg.host,
            cfg.port,
            reuse_address=True,
            backlog=c.BACKLOG,
        )
        for sock in self._listener.sockets:  # accepted connections inherit them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, c.SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, c.SOCKET_BUFFER_BYTES)
        self._timers = [
            loop.call_later(cfg.lease_sweep_interval_s, self._sweep),
            loop.call_later(cfg.gc_interval_s, self._gc),
        ]
        if (certificate := self.certificate) is not None:  # _timers[2]
            interval = cfg.tls_reload_interval_s
            self._timers.append(loop.call_later(interval, self._reload_tls, certificate))
        if grace.seconds > 0:
            self._timers.append(loop.call_later(grace.seconds, self._grace_over))
        if cfg.metrics_port is not None:
            bound = self._listener.sockets[0].getsockname()
            page = StatusPage(
                loop.call_soon_threadsafe,
                snapshots.request,  # on the loop
                f"{c.SERVER_NAME} {c.SERVER_VERSION} on {bound[0]}:{bound[1]}",
            )
            exporter = MetricsExporter(self._metrics_snapshot, loop, page)
            exporter.start(cfg.metrics_host or cfg.host, cfg.metrics_port)
            self.metrics = exporter
            self.request_times = RequestTimes()

    def _restore(self, plan: StartPlan, table: LockTable) -> int:
        """Put the journal's running leases back in the table, and go on writing the journal
        (``plan.resume``) or start a new file holding them (an old one, damaged tail and all, is
        replaced); the highest fence among them, which the caller raises the counter above
        (before any grant)."""
        assert plan.journal is not None
        journal = Journal(plan.journal, self.config.journal_fsync, table.clock)
        with paused_gc():
            restored, highest, refused = table.restore_all(plan.leases)
        for rec in refused:
            log.warning("journal: not restored (its key is full or of another limit): %s", rec.key)
        journal.anchor()
        if plan.resume:
            journal.resume([*plan.ended, *(rec.token for rec in refused)])
        else:
            journal.open(self._live_records(journal, table))
        journal.stats.restored = restored
        if plan.read is not None and plan.read.damage:
            journal.stats.dropped_records = plan.read.dropped_lines
        table.grants.journal = journal
        self.journal = self.group_write.journal = journal
        self.group_write.undo = table.release
        if not journal.writable:
            log.warning(
                "journal: starting read-only: the %d lease(s) restored are kept and served "
                "(renewals, releases, reattaching), %s is left as it is, and nothing new is "
                "granted (error_read_only) until the state directory can be written again",
                restored,
                plan.journal,
            )
        self._hello = self._make_hello(durable=True)
        log.info(
            "journal: restored %d lease(s) from %s (fsync %s)",
            restored,
            plan.journal,
            self.config.journal_fsync,
        )
        return highest

    @staticmethod
    def _live_records(journal: Journal, table: LockTable) -> list[bytes]:
        """A grant record for every lease held now (the journal's new file or compaction)."""
        lines: list[bytes] = []
        for holder, state, on_close in table.live_holders():
            detached = holder.client is table.grants.detached
            lines.append(journal.grant_record(holder, state, detached, on_close))
        return lines

    async def _stop_accepting(self, listener: asyncio.Server) -> None:
        """Stop accepting; the connections accepted last get their transports (refused and
        closed: the server drains) before the listener closes. On asyncio's own loop (3.11), a
        connection accepted the turn before ``close()`` gets its transport a turn later, whose
        constructor fails (``Server._attach`` asserts the server is open) and leaves the socket
        to the garbage collector (over a thousand in a storm of connections). Not uvloop."""
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

    def cut_drain(self) -> None:
        """End a drain under way now, as if its timeout had passed (an operator's second
        signal)."""
        self._drain_cut = True

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
        # Blocked acquires and queued two-phase waiters are refused now, not granted in the
        # last moments before exit.
        table = self.table
        connections = self.admission.connections
        refused = 0
        for conn in list(connections):
            refused += conn.waiter is not None
            conn.answer_wait(p.REPLY_ERROR_DRAINING)
        refused += table.drop_queued()
        if timeout_s is None:
            # With a journal (and no cluster to hand keys to), the leases outlive this run:
            # their holders reattach to the next one, so there is nothing to wait for.
            durable = self.journal is not None and self.node is None
            timeout_s = 0.0 if durable else self.config.shutdown_timeout_s
        log.info(
            "draining: %d lock(s) held, %d waiter(s) refused; waiting up to %gs for releases",
            table.held,
            refused,
            timeout_s,
        )
        deadline = self.loop.time() + timeout_s
        while table.held and connections and self.loop.time() < deadline and not self._drain_cut:
            await asyncio.sleep(c.DRAIN_POLL_S)
        if table.held and connections:
            log.info("shutdown timeout reached with %d lock(s) held", table.held)
        for timer in self._timers:
            timer.cancel()
        if self.snapshots is not None:
            self.snapshots.flush()  # a last snapshot for whoever still waits for one
        if self.node is not None:
            # The member stops deciding first (a step still under way when its wait ends
            # goes on, and may hand shards over).
            await self.loop.run_in_executor(None, self.node.halt)
        # The journal is closed before the connections: closing them here is this run's
        # end, not their holders' release; the next run restores their leases. The table
        # keeps their grants till their leases end (``LockTable.disconnect``): their shards
        # count as held, and neither a late step nor the leave hands them over.
        self._close_state()
        for conn in list(connections):
            conn.drain_now()
        # Let the transports deliver their last bytes and report connection_lost.
        for _ in range(3):
            await asyncio.sleep(0)
        settled_by = self.loop.time() + c.STOP_SETTLE_S
        while self.admission.open_transports and self.loop.time() < settled_by:
            await asyncio.sleep(c.STOP_SETTLE_POLL_S)
        if self._listener is not None:
            await self._listener.wait_closed()
        if self.metrics is not None:
            await self.loop.run_in_executor(None, self.metrics.stop)
        if (node := self.node) is not None:
            # After the drain: the member releases the shards nobody holds (their heirs take
            # them at once), then leaves (its lease revoked); the shards cut off wait for the
            # failover (the longest lease).
            await self.loop.run_in_executor(None, node.stop)
        self._stopped.set()

    def set_ownership(self, ownership: Ownership) -> None:
        """Serve by ``ownership`` from now on (any thread): ``KeyServing.set_ownership``."""
        serving = self.serving
        serving.set_ownership(ownership)
        self.key_check = serving.key_check
        self.hold_check = serving.hold_check
        self.asked_check = serving.asked_check
        self.admit_ask = serving.admit_ask

    @property
    def group_write(self) -> GroupWrite:
        """The journal's group write (``stream.GroupWrite``), made at the start."""
        if self._group_write is None:
            raise RuntimeError("server not started")
        return self._group_write

    def fragment_delay(self, earlier: int) -> float:
        """How long a dripping sender goes unread after ``earlier`` delays in a row: doubling
        from ``FRAGMENT_READ_DELAY_S`` up to the cap, jittered so that drippers delayed
        together are not read again together."""
        delay = min(c.FRAGMENT_READ_DELAY_S * 2 ** min(earlier, 16), self._fragment_delay_cap)
        return delay * self._jitter.uniform(_JITTER_MIN, _JITTER_MAX)

    def _metrics_snapshot(self) -> Snapshot:
        """What a metrics scrape reports (on the loop)."""
        return Snapshot.take(
            self.table,
            self.request_times,
            len(self.admission.connections),
            self.admission.connections_accepted,
            self.admission.connections_refused,
            cluster=self.node.stats() if self.node is not None else None,
            journal=self.journal,
            tls_validity=self.certificate.validity if self.certificate is not None else None,
        )

    def stats(self) -> dict[str, Any]:
        out = self.table.stats(len(self.admission.connections))
        out["build"] = BUILD
        out["loop"] = loop_name(self.loop)
        out["grace_reason"] = self.grace_reason if out["grace_remaining_s"] else ""
        out["journal"] = None
        if (journal := self.journal) is not None:
            out["journal"] = {
                "state_dir": os.path.dirname(journal.path),
                "fsync": journal.fsync,
                "restored": journal.stats.restored,
                "dropped_records": journal.stats.dropped_records,
                "writes": journal.stats.writes,
                "fsyncs": journal.stats.fsyncs,
                "compactions": journal.stats.compactions,
                "writable": journal.writable,
                "write_failure": journal.failure,
            }
        out["degraded"] = [condition.as_json() for condition in self.conditions(out)]
        return out

    def conditions(self, stats: dict[str, Any]) -> list[Condition]:
        """What it cannot do now, for an operator (``conditions``; ``stats`` is this
        snapshot's, for its grace)."""
        found: list[Condition] = []
        if (journal := self.journal) is not None and not journal.writable:
            directory = os.path.dirname(journal.path)
            found.append(
                conditions.read_only(
                    journal.failure, directory, journal.advice(), renewals=journal.mark_removed
                )
            )
        if self.draining:
            found.append(conditions.draining())
        left = stats.get("grace_remaining_s") or 0.0
        if left > 0:
            found.append(conditions.grace(left, self.grace_reason, time.time() + left))
        if self.node is not None:
            cluster = self.node.stats()
            found += conditions.cluster_conditions(
                cluster.fenced, cluster.fenced_reason, cluster.shards
            )
            if cluster.clock_off:
                found.append(
                    conditions.clock_off(cluster.clock_offset_s, cluster.clock_peer, TICKET_LIFE_S)
                )
        return found

    def _sweep(self) -> None:
        self._timers[0] = self.loop.call_later(self.config.lease_sweep_interval_s, self._sweep)
        table = self.table
        table.expire()
        stalled = len(table.grants.stalled)
        if stalled != self._stalled_said:
            self._stalled_said = stalled
            if stalled:
                log.error(
                    "no token could be issued to the next waiter of %d key(s) (its fence "
                    "ceiling or lease bound could not be stored yet); tried again at each lease "
                    "sweep",
                    stalled,
                )
            else:
                log.info("the waiters of every key are granted again as their turn comes")
        if (journal := self.journal) is not None:
            self._journal_upkeep(journal)

    def _journal_upkeep(self, journal: Journal) -> None:
        """At each sweep: write what no reply has (expiries, disconnects), fsync (everysec)
        off the loop, compact when the file is mostly leases gone."""
        table = self.table
        group_write = self.group_write
        group_write.settle(journal)
        if not journal.writable:
            # The probe: a new file with every lease held now; the waiters go first after it.
            if journal.recover(self._live_records(journal, table)):
                table.grants.fill_waiting()
            return
        if journal.wants_compaction(table.held):
            journal.compact(self._live_records(journal, table))
            group_write.settle(journal)
        journal.sync_in_background()

    def _grace_over(self) -> None:
        table = self.table
        waiting = table.queued
        remaining = table.grace_remaining()  # at its end, grants the waiters queued in it
        if remaining > 0:  # a timer may fire a hair early
            self._timers.append(self.loop.call_later(remaining, self._grace_over))
            return
        log.info("restart grace over: granting keys (%d waiter(s) were queued)", waiting)

    def _reload_tls(self, certificate: ServedCertificate) -> None:
        """New handshakes take the certificate files' new pair once they change."""
        interval = self.config.tls_reload_interval_s
        self._timers[2] = self.loop.call_later(interval, self._reload_tls, certificate)
        if certificate.reload():
            self.ssl_context = certificate.context

    def _gc(self) -> None:
        self._timers[1] = self.loop.call_later(self.config.gc_interval_s, self._gc)
        if pruned := self.table.gc(self.config.gc_max_idle_s):
            log.debug("pruned %d idle key(s)", pruned)
