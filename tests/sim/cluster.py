"""One simulated run of a lock cluster: members, etcd, clients routed by the map, a nemesis.

The members are the product's: each is a simulated server process (``server.SimServer``)
whose ownership is a real ``ClusterNode`` with its real ``Member``, ``Handover``, fence counter
(its ceilings in etcd: ``fencestore.EtcdCeilingStore``), ask tickets and decisions
(``decide.decide``, ``snapshot.ClusterOwnership``), driven by steps instead of threads
(``ClusterNode.step``, ``Member.keep_alive_step``, ``Member.step``) on the simulated clock;
etcd is ``etcd.SimEtcd``. The clients route by the map (``clusterclient.ClusterClient``).

Keys are few, two by two on one shard of the 8192 (``KEY_PAIRS``); two or three members are in the
cluster at the start, and a spare may join (and one leave) later, so shards move: handovers,
key-level moves (splits, ``error_ask`` with tickets), failovers, releases on a graceful leave.

The members run with client sessions (the server's default ``--session-ttl``): each client
keeps one session per member, as the product's pool does (``clusterclient``).

The faults (``CLUSTER_FAULTS``), chosen from the seed: a member killed and restarted in place
(``member_kill``; ``member_reboot`` also steps its wall clock and starts a new boot), paused
(now and then longer than its etcd lease: it must fence itself), cut off from etcd, etcd
stalled or out, a member leaving gracefully or joining, a connection of a member reset (its
grants kept by their client session while the holder reattaches), and the clients' faults
(killed, paused, cut off; an old ask ticket replayed).

What is the simulator's own (mirrored, not the product's): the threads' loops around the steps
(``SimMember._tick``/``_news``: the node's thread steps every ``NODE_STEP_S`` and soon after
news from its watch, where the real one ticks every ``NODE_TICK_S``; the member's loop steps
every ``Member.step_interval`` and is not woken by news; the keep-alive thread every
``Member.keepalive_interval``), ``SimServer``'s connection handling (``Connection.answer_wait``,
the lease bound's recording thread: ``leasebound.LeaseBound``), and a start's order
(``net.Server._start``: the counter from its ceiling in etcd, the bound published, then the
node). The defect ``asking-without-ticket`` is written in ``SimServer.admit_ask``.

The verdict is the single run's: the history checker (per key: no double grant, fences in
grant order; no FIFO across members), and at each grant that its fence is above every fence of
the key before (whichever member granted it) and that no client still believes it holds the
key; every tenth of a second, that no client believes in a grant the member it holds it from
no longer holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from dflockd_server.cluster.etcd import Put
from dflockd_server.cluster.fencestore import EtcdCeilingStore
from dflockd_server.cluster.node import ClusterNode, ask_secret_key
from dflockd_server.cluster.shardmap import shard_id
from dflockd_server.fence import FenceStateError
from dflockd_server.serving import KeyServing
from dflockd_server.tokens import FenceCounter
from tests.faults.history import Cut
from tests.sim.client import ClientConn, SimClient
from tests.sim.clusterclient import ClusterClient
from tests.sim.etcd import SimEtcd, SimEtcdClient
from tests.sim.loop import Loop, Runaway
from tests.sim.mutations import Mutation
from tests.sim.network import Network
from tests.sim.process import Process
from tests.sim.result import Result
from tests.sim.server import InOrder, Machine, Mutations, ServerConfig, SimServer
from tests.sim.verdict import Verdict

if TYPE_CHECKING:
    from dflockd_server.connection import Connection

__all__ = ["CLUSTER_FAULTS", "ClusterRun"]

PREFIX = "/dflock"
ETCD_LEASE_S = 5
"""The members' etcd lease TTL (``--cluster-lease-ttl``'s default)."""
WALL_START_NS = 1_800_000_000 * 10**9
NODE_STEP_S = 1.0
"""How often a node steps without news: its thread's tick is ``NODE_TICK_S``, here a thread
that runs late (each step that decides walks the 8192 shards a few times: the simulator's
time goes there)..."""
NEWS_STEP_S = 0.05
"""...and how soon after news from its watch (its thread is woken, and lets news settle up to
``NODE_MAX_DEFER_S``)."""

KEY_PAIRS = (
    ("k0", "k0.6112"),
    ("k1", "k1.15787"),
    ("k2", "k2.1045"),
    ("k3", "k3.547"),
    ("k4", "k4.8598"),
)
"""Keys two by two on one shard each (``shard_id`` equal: found by a search): while one is
held, a shard moving out is split and the other is asked for at its new member
(``error_ask``), a key-level move."""

CLUSTER_FAULTS = (
    "member_kill",
    "member_reboot",
    "member_pause",
    "etcd_partition",
    "etcd_stall",
    "etcd_outage",
    "member_leave",
    "member_join",
    "kill",
    "pause",
    "partition",
    "reset",
    "quiet",
    "quiet",
)


def table_holds(server: SimServer, key: str, token: str) -> bool:
    """Whether ``server``'s table holds the live grant ``token`` of ``key``."""
    from dflockd_server.keys import Holder

    entry = server.table.grants.keys.get(key)
    if isinstance(entry, Holder):
        return entry.live and entry.token == token
    if entry is None:
        return False
    one = entry.one
    if one is not None:
        return one.live and one.token == token
    holder = (entry.many or {}).get(token)
    return holder is not None and holder.live


class SimMember:
    """One cluster member: its process, machine, and (while it runs) its node and server."""

    def __init__(self, run: ClusterRun, index: int) -> None:
        loop = run.loop
        self.run = run
        self.name = f"m{index}"
        self.address = f"{self.name}:6388"
        self.proc = Process(loop, self.name, clock_offset=loop.uniform(100.0, 1e5))
        self.proc.alive = False
        self.wall_offset_ns = int(loop.uniform(-2.0, 2.0) * 1e9)
        """This machine's wall clock, off the run's by a little (and by a reboot's step)."""
        self.machine = Machine(self.wall_clock_ns, boot=f"{loop.rng.getrandbits(64):016x}")
        self.node: ClusterNode | None = None
        self.server: SimServer | None = None
        self.driven: object | None = None
        """The ``Member`` whose keep-alives and steps are scheduled."""
        self.listed = False
        """In the cluster (started, not removed)."""

    def wall_clock_ns(self) -> int:
        return WALL_START_NS + int(self.run.loop.now * 1e9) + self.wall_offset_ns

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """The process starts (again): a fence counter above its ceiling in etcd, a node, a
        server (retried whole after 1 s while etcd does not answer; the real start tries its
        lease bound's publish again in place, serving nothing meanwhile: ``LeaseBound.start``)."""
        run = self.run
        if not self.proc.alive:
            self.proc.start()
        client = SimEtcdClient(run.etcd, self.name, self.proc)
        # (a mutation's counter and store are those of a restart: a second life or later)
        restarted = self.proc.life > 1
        mutations = run.mutations
        store = (mutations.ceiling_store if restarted else EtcdCeilingStore)(
            client, PREFIX, self.address
        )
        try:
            fence = (mutations.fence_counter if restarted else FenceCounter)(
                store=store,
                wall_clock_ns=self.machine.wall_clock_ns,
                random_bytes=run.loop.rng.randbytes,
                persist_block=16,
            )
        except FenceStateError:
            run.loop.note(f"{self.name}: cannot read its fence ceiling in etcd: retrying")
            self.proc.later(1.0, self.start)
            return
        serving = KeyServing(cast("set[Connection]", InOrder()))
        node = ClusterNode(
            client,
            PREFIX,
            self.address,
            serving,
            max_lease_ttl_s=run.config.max_lease,
            lease_ttl_s=ETCD_LEASE_S,
            settle_s=1.0,
            auto_rebalance_s=10.0,
            clock=self.proc.clock,
            fence=fence,
            wall=lambda: self.machine.wall_clock_ns() / 1e9,
        )
        self.node = node
        self.soon = False
        client.on_news = lambda: self._news(node)
        try:
            self.server = SimServer(
                run.loop,
                self.proc,
                run.config,
                run.mutations,
                lambda key, token, ip: run.on_grant(self, key, token),
                self.machine,
                serving=serving,
                node=node,
            )
        except FenceStateError:
            run.loop.note(f"{self.name}: cannot publish its lease bound in etcd: retrying")
            self.node = None
            self.proc.later(1.0, self.start)
            return
        run.loop.note(f"{self.name}: started (grace {self.server.grace_s:.2f} s)")
        self.proc.later(0.0, lambda: self._tick(node))

    def _news(self, node: ClusterNode) -> None:
        """News from the watch wakes the node's thread: a step soon (once)."""
        if self.soon or self.node is not node:
            return
        self.soon = True

        def step() -> None:
            self.soon = False
            if self.node is node:
                self._step(node)

        self.proc.later(NEWS_STEP_S, step)

    def _tick(self, node: ClusterNode) -> None:
        """The node's thread: a step every ``NODE_STEP_S``."""
        if self.node is not node:
            return
        self._step(node)
        self.proc.later(NODE_STEP_S, lambda: self._tick(node))

    def _step(self, node: ClusterNode) -> None:
        stats = node.stats()
        was = (node.ownership.fenced, stats.handovers, stats.failovers, stats.released_takeovers)
        node.step()
        self._count(was, node)
        member = node.member
        if member is not None and member is not self.driven:
            self.driven = member
            self.proc.later(member.keepalive_interval, lambda: self._keep_alive(node, member))
            self.proc.later(member.step_interval, lambda: self._member_step(node, member))

    def _count(self, was: tuple[bool, int, int, int], node: ClusterNode) -> None:
        """What the step did, for ``Result.seen``: a member fencing itself, shards handed
        over, taken after a failover, taken at once after a release."""
        loop = self.run.loop
        fenced, handovers, failovers, released = was
        stats = node.stats()
        if node.ownership.fenced and not fenced:
            loop.note(f"{self.name}: fenced ({node.fenced_reason})")
            loop.count("member fenced itself")
        for kind, before, now in (
            ("handover", handovers, stats.handovers),
            ("failover", failovers, stats.failovers),
            ("released takeover", released, stats.released_takeovers),
        ):
            if now > before:
                loop.note(f"{self.name}: {now - before} shard(s): {kind}")
                loop.count(kind)

    def _keep_alive(self, node: ClusterNode, member: object) -> None:
        """The member's keep-alive thread."""
        current = node.member
        if self.node is not node or current is not member or current is None:
            return
        wait = current.keep_alive_step()
        if wait is not None:
            self.proc.later(wait, lambda: self._keep_alive(node, member))

    def _member_step(self, node: ClusterNode, member: object) -> None:
        """The member's own loop (the watch's upkeep, the election, the leader's map)."""
        current = node.member
        if self.node is not node or current is not member or current is None:
            return
        current.step()
        self.proc.later(current.step_interval, lambda: self._member_step(node, member))

    def crash(self) -> None:
        """SIGKILL: connections reset, nothing more runs; its etcd lease runs out by itself."""
        if self.server is not None:
            self.server.crash()
        self.proc.kill()
        self.node = self.server = None
        self.driven = None

    def leave(self) -> None:
        """A graceful leave: the node stops deciding, releases the shards nobody holds (the
        others wait for the failover), revokes its lease; then the process exits (its holders'
        connections are cut)."""
        node = self.node
        if node is not None and self.proc.alive and not self.proc.paused:
            node.stop(leave=True)
        self.crash()


class ClusterRun:
    """The parts of one cluster run and its invariants."""

    def __init__(
        self, seed: int, mutation: Mutation | None, duration: float, *, control: bool = False
    ) -> None:
        self.loop = loop = Loop(seed)
        self.duration = duration
        self.mutation = mutation
        self.net = Network(loop)
        self.etcd = SimEtcd(loop)
        self.clients: list[SimClient] = []
        self.verdict = Verdict(loop, self.clients)
        rng = loop.rng
        self.config = ServerConfig(default_lease=12, max_lease=20)
        self.mutations = Mutations()
        if mutation is not None:
            if mutation.scenario is not None:
                mutation.scenario(self.config)
            if not control:
                mutation.switch(self.mutations)
        self.faults = list(CLUSTER_FAULTS)
        if mutation is not None and mutation.faults is not None:
            self.faults = list(mutation.faults)
        self.members = [SimMember(self, i) for i in range(3)]
        self.by_address = {m.address: m for m in self.members}
        running = rng.choice([2, 3, 3])
        for member in self.members[:running]:
            member.listed = True
        seeds = [(m.name, 6388) for m in self.members[:running]]
        keys = [key for pair in KEY_PAIRS[: rng.randint(1, 3)] for key in pair]
        assert all(shard_id(a) == shard_id(b) for a, b in KEY_PAIRS)
        for i in range(rng.randint(2, 4)):
            proc = Process(loop, f"c{i}", clock_offset=rng.uniform(100.0, 1e5))
            client = ClusterClient(
                loop, proc, self.connect, f"10.0.0.{i % 2 + 1}", keys, self.verdict.holds, seeds
            )
            self.clients.append(client)

    # ------------------------------------------------------------------ invariants
    def on_grant(self, member: SimMember, key: str, token: str) -> None:
        """A grant leaves ``member`` (`Verdict.granted`)."""
        self.verdict.granted(key, token, by=member.name)

    def audit(self) -> None:
        """Every tenth of a second: no client believes in a grant its member does not hold
        (skipped while that member is down or in its restart grace)."""
        self.loop.later(0.1, self.audit)
        for client in self.verdict.believers():
            core = client.core
            assert core is not None and core.grant.token is not None
            member = self.by_address.get(core.endpoint.address)
            server = None if member is None else member.server
            if member is None or server is None or not member.proc.alive:
                continue
            if server.table.grants.in_grace:
                continue
            if not table_holds(server, core.key, core.grant.token):
                self.verdict.lost_belief(client, core.endpoint.address)

    # ------------------------------------------------------------------ connecting
    def connect(
        self, client: SimClient, timeout: float, done: Callable[[ClientConn | None, bool], None]
    ) -> None:
        """A TCP connect from ``client`` to the member it aims at (``client.aim``)."""
        member = self.by_address.get(client.aim)
        side = ClientConn(client)
        proc = member.proc if member is not None else Process(self.loop, "nobody", clock_offset=0)
        conn = self.net.connect(client.proc, proc, side)
        side.conn = conn
        settled = False

        def settle(ok: bool, refused: bool) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            if ok:
                done(side, False)
            else:
                conn.close_by_client(reset=True)
                side.gone = True
                done(None, refused)

        def syn() -> None:
            server = None if member is None else member.server
            if member is None or server is None or not member.proc.alive:
                self.net.send(conn, False, lambda: client.proc.run(lambda: settle(False, True)))
                return
            conn.server_life = member.proc.life
            member.proc.run(lambda: server.accept(conn, client.ip))
            self.net.send(conn, False, lambda: client.proc.run(lambda: settle(True, False)))

        self.net.send(conn, True, syn)
        client.proc.later(timeout, lambda: settle(False, False))

    # ------------------------------------------------------------------ faults
    def nemesis(self) -> None:
        loop = self.loop
        rng = loop.rng
        fault = rng.choice(self.faults)
        running = [m for m in self.members if m.listed]
        member = rng.choice(running) if running else None
        client = rng.choice(self.clients)
        done = True
        if fault in {"member_kill", "member_reboot"} and member is not None and member.proc.alive:
            loop.note(f"nemesis: {member.name} killed")
            self.verdict.cuts.append(Cut(loop.now, None))
            member.crash()
            if fault == "member_reboot":
                step = rng.uniform(-600.0, 600.0)
                loop.note(f"nemesis: {member.name} reboots, its wall clock stepped {step:+.1f} s")
                member.wall_offset_ns += int(step * 1e9)
                member.proc.clock_offset = rng.uniform(1.0, 100.0) - loop.now
                member.machine.boot = f"{rng.getrandbits(64):016x}"
            loop.later(rng.uniform(0.5, 8.0), lambda m=member: self._restart(m))
        elif fault == "member_pause" and member is not None and member.proc.alive:
            long = rng.random() < 0.4
            member.proc.pause(
                rng.uniform(ETCD_LEASE_S + 1.0, 25.0) if long else rng.uniform(0.2, 3.0)
            )
        elif fault == "etcd_partition" and member is not None:
            long = rng.random() < 0.4
            self.etcd.partition(
                member.name, rng.uniform(ETCD_LEASE_S, 25.0) if long else rng.uniform(0.3, 3.0)
            )
        elif fault == "etcd_stall":
            self.etcd.stall(rng.uniform(0.5, 8.0))
        elif fault == "etcd_outage":
            self.etcd.outage(rng.uniform(0.5, 10.0))
        elif fault == "member_leave" and len(running) > 2 and member is not None:
            if member.proc.alive:
                loop.note(f"nemesis: {member.name} leaves the cluster")
                self.verdict.cuts.append(Cut(loop.now, None))
                member.leave()
            member.listed = False
        elif fault == "member_join":
            spare = [m for m in self.members if not m.listed]
            if spare:
                joining = spare[0]
                joining.listed = True
                loop.note(f"nemesis: {joining.name} joins the cluster")
                if not joining.proc.alive:
                    joining.start()
            else:
                done = False
        elif fault == "kill" and client.proc.alive:
            loop.note(f"nemesis: kill {client.name}")
            self.verdict.cuts.append(Cut(loop.now, client.name))
            client.kill()
            client.proc.kill()
            loop.later(rng.uniform(0.5, 5.0), lambda c=client: self._restart_client(c))
        elif fault == "pause" and client.proc.alive:
            client.proc.pause(rng.choice([rng.uniform(0.2, 3.0), rng.uniform(3.0, 30.0)]))
        elif fault == "partition":
            self.net.partition(client.name, rng.choice([rng.uniform(0.5, 4.0), rng.uniform(4, 40)]))
        elif fault == "reset" and member is not None and member.server is not None:
            server = member.server
            conns = list(server.conns.values())
            if conns:
                conn, _ = rng.choice(conns)
                loop.note(f"nemesis: reset connection {conn.id} of {member.name}")
                conn.close_by_server(reset=True)
                member.proc.run(lambda: server.closed(conn, reset=True))
            done = bool(conns)
        else:
            done = fault == "quiet"
        if done:
            loop.count(fault)
        loop.later(rng.uniform(2.0, 10.0), self.nemesis)

    def _restart(self, member: SimMember) -> None:
        if member.listed and not member.proc.alive:
            loop = self.loop
            loop.note(f"{member.name} restarted in place")
            member.start()

    def _restart_client(self, client: SimClient) -> None:
        client.proc.start()
        self.loop.note(f"{client.name} restarted")
        client.start()

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        loop = self.loop
        # The cluster's ask secret, as the first member to start would have created it
        # (``node.load_ask_tickets``), from the seed: a run's tickets are the same at a replay.
        secret = f"{loop.rng.getrandbits(256):064x}"
        self.etcd.txn([], [Put(ask_secret_key(PREFIX), secret)], [])
        for member in self.members:
            if member.listed:
                member.start()
        for client in self.clients:
            client.proc.later(loop.uniform(1.0, 3.0), client.start)
        loop.later(loop.uniform(5.0, 12.0), self.nemesis)
        loop.later(0.1, self.audit)
        try:
            loop.run_until(self.duration)
        except Runaway as exc:
            self.verdict.violation(f"runaway: {exc}")
        mutation = self.mutation
        return self.verdict.result(None if mutation is None else mutation.name, cluster=True)
