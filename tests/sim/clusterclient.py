"""A simulated client of a lock cluster: its locks routed by the shard map.

The decisions are the client's own code: ``ClusterRouter`` (the cached map, when to read it
again, where to ask for it), ``KeyRoute`` through ``LockCore`` (where a key's acquire goes, how
it follows ``error_moved``, ``error_unavailable``, ``error_ask <member> <ticket>`` with
``asking``, a member that cannot be reached, the pauses), ``ClusterMap`` (the ``shards`` reply
parsed, a key's shard and member). The shell around them is the simulator's, written after
``celery_dflock/client/_async/lock.py`` (``_grant_routed``, ``_reroute``) and
``routing.py`` (``refresh_map``); renewal, reattach, release, the client session with each
member (joined by every connection to it, kept alive while a lock holds or waits on it) and a
grant's confirmation after its session ended are ``SimClient``'s, sent to the member that
granted.

A client fault of its own: now and then an acquire of a key whose shard moves (by its cached
map; such a key is chosen then) goes to the shard's target with ``asking`` and a ticket that is
not for it (the last one this client got, for another key or move, or a made-up one): a member
must admit an ``asking`` only with a ticket for that very key and move
(``--mutation asking-without-ticket``).
"""

from __future__ import annotations

from collections.abc import Callable

from celery_dflock.client import _replies, _requests
from celery_dflock.client._core import LockCore
from celery_dflock.client._replies import Asked, Ok, Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._router import ClusterRouter, split_address
from celery_dflock.client._settings import ClientSettings
from celery_dflock.client.cluster import ClusterMap
from celery_dflock.client.errors import DflockError, ServerUnavailable
from tests.faults.history import Hold
from tests.sim.client import ClientConn, SimClient
from tests.sim.loop import Loop
from tests.sim.process import Process

__all__ = ["ClusterClient"]


class ClusterClient(SimClient):
    """One client process of a cluster (see the module's doc)."""

    def __init__(
        self,
        loop: Loop,
        proc: Process,
        connect: Callable[[SimClient, float, Callable[[ClientConn | None, bool], None]], None],
        ip: str,
        keys: list[str],
        holds: list[Hold],
        seeds: list[tuple[str, int]],
    ) -> None:
        super().__init__(loop, proc, connect, ip, keys, holds)
        self.settings = ClientSettings.checked(
            servers=seeds, sharding_strategy="cluster", connect_timeout_s=5.0
        )
        self.endpoint = self.settings.endpoints()[0]
        self.router = ClusterRouter(seeds)
        self.conns: dict[str, ClientConn] = {}
        """Its connections, by member address (a pool of one each)."""
        self.last_ask: tuple[str, str] | None = None
        """(member, ticket) of the last ``error_ask`` it followed (the replay fault's)."""
        self.maps: dict[bytes, tuple[Reply, ClusterMap | None]] = {}
        """``shards`` replies read, and their maps (the run's time would go to parsing the
        same 8192 shards again and again: both are pure functions of the line)."""

    def decode(self, command: Command, line: bytes) -> Reply:
        if command is not Command.SHARDS:
            return super().decode(command, line)
        known = self.maps.get(line)
        if known is None:
            known = self.maps[line] = (super().decode(command, line), None)
            if len(self.maps) > 8:
                del self.maps[next(iter(self.maps))]
        return known[0]

    def cluster_map(self, reply: _replies.JsonReply, where: str) -> ClusterMap:
        """``ClusterMap.parse`` of ``reply`` (once per reply read: ``maps``)."""
        for line, (known, parsed) in self.maps.items():
            if known is reply:
                if parsed is not None:
                    return parsed
                made = ClusterMap.parse(reply.data or {}, where)
                self.maps[line] = (known, made)
                return made
        return ClusterMap.parse(reply.data or {}, where)

    def start(self) -> None:
        self.router = ClusterRouter(self.router.seeds)
        self.conns = {}
        super().start()

    def kill(self) -> None:
        super().kill()
        for conn in self.conns.values():
            if conn.conn is not None:
                conn.conn.close_by_client(reset=True)
        self.conns = {}

    # ------------------------------------------------------------------ connections
    def server_address(self) -> str:
        """The member the lock's requests go to (``core.endpoint``)."""
        core = self.core
        return core.endpoint.address if core is not None else self.aim

    def _checkout(self, address: str, done: Callable[[ClientConn | None, bool], None]) -> None:
        """A connection to ``address``: the open one (`_reusable`), else a new one."""
        conn = self.conns.get(address)
        if conn is not None and self._reusable(conn):
            done(conn, False)
            return

        def made(conn: ClientConn | None, refused: bool) -> None:
            if conn is not None:
                self.conns[address] = conn
            done(conn, refused)

        self.dial(address, made)

    # ------------------------------------------------------------------ acquire
    def _acquire(self) -> None:
        rng = self.loop.rng
        key = rng.choice(self.keys)
        moving = self._moving_keys()
        forged = bool(moving) and self.loop.chance(0.3)
        if forged:
            key = rng.choice(moving)
        lease = rng.choice([None, 4, 8, 15])
        timeout = rng.choice([0, 2, 10])
        core = LockCore(
            key, self.settings, acquire_timeout_s=timeout, lease_ttl_s=lease, router=self.router
        )
        core.routing.clock = self.clock
        core.routing.jitter = rng.random
        self._begin(core, lease)
        core.begin_acquire()
        if forged:
            self._forge_asking(core)
            self._try(core)
            return
        if not core.routing.route():
            self._refresh(core, lambda: self._routed(core))
            return
        self._try(core)

    def _moving_keys(self) -> list[str]:
        """Its keys whose shard moves by its cached map (its target is not its current)."""
        cluster_map = self.router.map
        if cluster_map is None:
            return []
        found: list[str] = []
        for key in self.keys:
            shard = cluster_map.shard_of(key)
            if 0 <= cluster_map.target[shard] != cluster_map.current[shard]:
                found.append(key)
        return found

    def _forge_asking(self, core: LockCore) -> None:
        """The client fault: this acquire (of a key whose shard moves) asks the shard's target
        with ``asking`` and a ticket that is not for it (the last one this client got, for
        whatever key and move; or a made-up one)."""
        cluster_map = self.router.map
        assert cluster_map is not None
        member = cluster_map.nodes[cluster_map.target[cluster_map.shard_of(core.key)]]
        ticket = self.last_ask[1] if self.last_ask is not None else f"1.1.1.{'0' * 32}"
        self.loop.note(f"{self.name}: asks {member} for {core.key} with a ticket not for it")
        self.loop.count("ticket replayed")
        core.routing.retarget(*split_address(member))
        core.routing.asking = True
        core.routing.ask_ticket = ticket

    def _routed(self, core: LockCore) -> None:
        if self.core is not core:
            return
        core.routing.route()
        self._try(core)

    def _refresh(self, core: LockCore, then: Callable[[], None]) -> None:
        """``routing.refresh_map``: the map from the first candidate that answers ``shards``
        (unless a refresh started too recently)."""
        router = self.router
        if not router.claim_refresh(self.clock()):
            then()
            return
        candidates = [f"{host}:{port}" for host, port in router.candidates()]

        def ask(rest: list[str]) -> None:
            if self.core is not core:
                return
            if not rest:
                if router.map is None:
                    self._end(core, "error")
                    return
                then()
                return
            address = rest[0]

            def connected(conn: ClientConn | None, refused: bool) -> None:
                if self.core is not core:
                    return
                if conn is None:
                    ask(rest[1:])
                    return

                def answered(reply: Reply | None) -> None:
                    if self.core is not core:
                        return
                    if isinstance(reply, _replies.JsonReply) and reply.data is not None:
                        try:
                            router.update(self.cluster_map(reply, address))
                        except DflockError:
                            ask(rest[1:])
                            return
                        self.loop.count("map read")
                        then()
                        return
                    ask(rest[1:])

                conn.request(Command.SHARDS, _requests.SHARDS_REQUEST, 10.0, answered)

            self._checkout(address, connected)

        ask(candidates)

    def _end(self, core: LockCore, outcome: str) -> None:
        core.routing.end_acquire()
        if self.core is core:
            self._finish(outcome)

    def _pause_then(self, core: LockCore, seconds: float, then: Callable[[], None]) -> None:
        self.proc.later(seconds, lambda: then() if self.core is core else None)

    def _reroute(self, core: LockCore, why: str) -> None:
        """``AsyncLockBase._reroute``: the key's member could not serve the acquire."""
        wait = core.routing.on_unreachable(ServerUnavailable(why))
        if wait is None:
            self._end(core, "error")
            return
        self._pause_then(core, wait, lambda: self._refresh(core, lambda: self._routed(core)))

    def _try(self, core: LockCore) -> None:
        """One pass of ``AsyncLockBase._grant_routed``'s loop."""
        address = core.endpoint.address

        def connected(conn: ClientConn | None, refused: bool) -> None:
            if self.core is not core:
                return
            if conn is None:
                self._reroute(core, f"{address} unreachable")
                return
            if core.routing.asking:
                core.routing.asking = False  # one request only
                self._ask(conn, core)
                return
            self._send(conn, core)

        self._checkout(address, connected)

    def _ask(self, conn: ClientConn, core: LockCore) -> None:
        def answered(reply: Reply | None) -> None:
            if self.core is not core:
                return
            if reply is None:
                self._reroute(core, "no answer to asking")
                return
            if not isinstance(reply, Ok):
                self.loop.count("asking refused")
                wait = core.routing.on_ask_refused()
                if wait is None:
                    self._end(core, "timeout")
                    return
                self._pause_then(core, wait, lambda: self._routed(core))
                return
            self.loop.count("asking admitted")
            self._send(conn, core)

        conn.request(
            Command.ASKING,
            _requests.checked_asking(core.key, core.routing.ask_ticket),
            10.0,
            answered,
        )

    def _send(self, conn: ClientConn, core: LockCore) -> None:
        command, data, timeout = core.acquire_request(self.info)
        sent = self.clock()
        self.loop.note(f"{self.name}: {data!r} to {core.endpoint.address}")
        self._keep_while_waiting(conn, core.routing.acquire_timeout_s > 0)

        def answered(reply: Reply | None) -> None:
            if self.core is not core:
                return
            self._keep_while_waiting(conn, False)
            if reply is None:
                self._reroute(core, "no answer")
                return
            if isinstance(reply, Asked):
                self.loop.count("error_ask")
                if reply.ticket:
                    self.last_ask = (reply.address, reply.ticket)
                step = core.routing.on_ask(reply)
                if step is None:
                    self._end(core, "timeout")
                elif step.reroute:
                    self.router.invalidate()
                    self._pause_then(
                        core, step.pause_s, lambda: self._refresh(core, lambda: self._routed(core))
                    )
                else:
                    self._try(core)
                return
            if core.routing.redirected(reply):
                self.loop.count("redirected")
                step = core.routing.on_redirect(reply)
                if step is None:
                    self._end(core, "timeout")
                    return
                if step.reread:
                    self.router.invalidate()

                def then() -> None:
                    if step.reroute:
                        core.routing.route()
                    self._try(core)

                self._pause_then(core, step.pause_s, lambda: self._refresh(core, then))
                return
            try:
                held = core.on_grant_reply(command, reply, sent, self.info, conn.session)
            except DflockError:
                self._end(core, "error")
                return
            core.routing.end_acquire()
            if not held:
                self._finish("timeout")
                return
            self.conn = conn
            self._start_renewing(conn, core)

        conn.request(command, data, timeout, answered)
