"""One simulated run from one seed: a server, a few clients, a nemesis, and the verdict.

``simulate(seed)`` builds the run from the seed alone, runs it for ``duration`` simulated
seconds and returns a ``Result``: the violations found (empty: the run is good), the trace's
digest (equal for every run of one seed: the replay is exact) and the trace's last lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dflockd_server import constants as c
from dflockd_server.keys import Holder
from tests.faults.history import Cut
from tests.sim.client import ClientConn, SimClient
from tests.sim.cluster import ClusterRun
from tests.sim.disk import Disk
from tests.sim.loop import Loop, Runaway
from tests.sim.mutations import MUTATIONS, Mutation
from tests.sim.network import Network
from tests.sim.process import Process
from tests.sim.result import Result
from tests.sim.server import Machine, Mutations, ServerConfig, SimServer
from tests.sim.verdict import Verdict

__all__ = ["Result", "simulate"]

WALL_START_NS = 1_800_000_000 * 10**9
"""The wall clock at the run's start (any fixed value: the run never reads the real one)."""


class Run:
    """The parts of one run and its invariants."""

    def __init__(
        self, seed: int, mutation: Mutation | None, duration: float, *, control: bool = False
    ) -> None:
        self.loop = loop = Loop(seed)
        self.duration = duration
        self.mutation = mutation
        self.net = Network(loop)
        self.clients: list[SimClient] = []
        self.verdict = Verdict(loop, self.clients)
        self.granted_to: dict[str, tuple[str, str]] = {}
        """Token -> (key, address), for the per-address cap's invariant."""
        self.wall_offset_ns = 0
        rng = loop.rng
        mutations = Mutations()
        config = ServerConfig(
            read_timeout=rng.choice([23.0, 8.0]),
            locks_per_ip=rng.choice([0, 0, 2]),
            journal_fsync=rng.choice([None, "always", "always", "everysec"]),
        )
        if mutation is not None:
            if mutation.scenario is not None:
                mutation.scenario(config)
            if not control:
                mutation.switch(mutations)
        self.config = config
        self.server_proc = Process(loop, "server", clock_offset=rng.uniform(100.0, 1e5))
        self.mutations = mutations
        self.machine = Machine(
            self.wall_clock_ns,
            disk=None if config.journal_fsync is None else Disk(loop),
            boot=f"{rng.getrandbits(64):016x}",
        )
        self.server = self._new_server()
        self.faults = [
            "kill",
            "pause",
            "reset",
            "partition",
            "server_pause",
            "quiet",
            "quiet",
            "server_restart",
            "server_reboot",
            "disk_full",
            "disk_failing",
            "dir_fsync_failing",
        ]
        if mutation is not None and mutation.faults is not None:
            self.faults = list(mutation.faults)
        keys = [f"k{i}" for i in range(rng.randint(1, 3) + (2 if config.locks_per_ip else 0))]
        for i in range(rng.randint(2, 4)):
            proc = Process(loop, f"c{i}", clock_offset=rng.uniform(100.0, 1e5))
            ip = f"10.0.0.{i % 2 + 1}"
            client = SimClient(loop, proc, self.connect, ip, keys, self.verdict.holds)
            client.detached_holds = bool(config.locks_per_ip)
            self.clients.append(client)

    # ------------------------------------------------------------------ the server
    def wall_clock_ns(self) -> int:
        return WALL_START_NS + int(self.loop.now * 1e9) + self.wall_offset_ns

    def _new_server(self) -> SimServer:
        return SimServer(
            self.loop, self.server_proc, self.config, self.mutations, self.on_grant, self.machine
        )

    def on_grant(self, key: str, token: str, ip: str) -> None:
        """A grant leaves the server: the invariants that hold at that moment (the verdict's,
        and the per-address cap's)."""
        self.verdict.granted(key, token)
        cap = self.config.locks_per_ip
        if cap:
            self.granted_to[token] = (key, ip)
            live = {h.token for h, _, _ in self.server.table.live_holders()}
            held = sum(1 for t, (_, a) in self.granted_to.items() if a == ip and t in live)
            if held > cap:
                self.verdict.violation(f"{ip} holds {held} grants, above --max-locks-per-ip {cap}")

    def audit(self) -> None:
        """Every tenth of a second: no client believes in a grant the running server does not
        hold for it (freed, expired, or never restored). A server in its restart grace is
        skipped: it grants nothing until every lease it may have made has ended."""
        self.loop.later(0.1, self.audit)
        if not self.server_proc.alive or self.server.table.grants.in_grace:
            return
        for client in self.verdict.believers():
            core = client.core
            assert core is not None and core.grant.token is not None
            if not self._server_holds(core.key, core.grant.token):
                self.verdict.lost_belief(client, "the server")

    def _server_holds(self, key: str, token: str) -> bool:
        """Whether the server's table holds the live grant ``token`` of ``key``."""
        entry = self.server.table.grants.keys.get(key)
        if isinstance(entry, Holder):
            return entry.live and entry.token == token
        if entry is None:
            return False
        one = entry.one
        if one is not None:
            return one.live and one.token == token
        holder = (entry.many or {}).get(token)
        return holder is not None and holder.live

    # ------------------------------------------------------------------ connecting
    def connect(
        self, client: SimClient, timeout: float, done: Callable[[ClientConn | None, bool], None]
    ) -> None:
        """A TCP connect from ``client`` to the server: made, refused (nobody listens), or
        timed out (``connect_timeout_s``)."""
        side = ClientConn(client)
        conn = self.net.connect(client.proc, self.server_proc, side)
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

        def syn() -> None:  # at the server's kernel
            server = self.server
            if not self.server_proc.alive:
                self.net.send(conn, False, lambda: client.proc.run(lambda: settle(False, True)))
                return
            conn.server_life = self.server_proc.life
            self.server_proc.run(lambda: server.accept(conn, client.ip))
            self.net.send(conn, False, lambda: client.proc.run(lambda: settle(True, False)))

        self.net.send(conn, True, syn)
        client.proc.later(timeout, lambda: settle(False, False))

    # ------------------------------------------------------------------ faults
    def nemesis(self) -> None:
        loop = self.loop
        rng = loop.rng
        fault = rng.choice(self.faults)
        loop.count(fault)
        client = rng.choice(self.clients)
        if fault == "kill" and client.proc.alive:
            loop.note(f"nemesis: kill {client.name}")
            self.verdict.cuts.append(Cut(loop.now, client.name))
            client.kill()
            client.proc.kill()
            self.reset_conns_of(client)
            down = rng.uniform(0.5, 5.0)
            loop.later(down, lambda: self.restart_client(client))
        elif fault == "pause" and client.proc.alive:
            client.proc.pause(rng.choice([rng.uniform(0.2, 3.0), rng.uniform(3.0, 30.0)]))
        elif fault == "reset":
            conns = list(self.server.conns.values())
            if conns:
                conn, _ = rng.choice(conns)
                loop.note(f"nemesis: reset connection {conn.id}")
                conn.close_by_server(reset=True)
                self.server_proc.run(lambda: self.server.closed(conn, reset=True))
        elif fault == "partition":
            self.net.partition(client.name, rng.choice([rng.uniform(0.5, 4.0), rng.uniform(4, 40)]))
        elif fault == "server_pause":
            self.server_proc.pause(rng.uniform(0.2, 12.0))
        elif fault == "server_restart" and self.server_proc.alive:
            self.restart_server()
        elif fault == "server_reboot" and self.server_proc.alive:
            step = rng.uniform(-600.0, 600.0)
            loop.note(f"nemesis: reboot, the wall clock stepped {step:+.1f} s")
            self.restart_server()
            self.wall_offset_ns += int(step * 1e9)
            self.server_proc.clock_offset = rng.uniform(1.0, 100.0) - loop.now  # a new boot
            self.machine.boot = f"{rng.getrandbits(64):016x}"
            if self.machine.disk is not None:
                self.machine.disk.crash()
        elif fault in {"disk_full", "disk_failing", "dir_fsync_failing"} and (
            self.machine.disk is not None
        ):
            disk = self.machine.disk
            seconds = rng.uniform(0.5, 20.0)
            loop.note(f"nemesis: {fault} for {seconds:.2f} s")
            if fault == "disk_full":
                disk.full = True
                loop.later(seconds, lambda: setattr(disk, "full", False))
            elif fault == "disk_failing":
                disk.failing = True
                loop.later(seconds, lambda: setattr(disk, "failing", False))
            else:
                disk.dir_failing = True
                loop.later(seconds, lambda: setattr(disk, "dir_failing", False))
        loop.later(rng.uniform(1.0, 8.0), self.nemesis)

    def reset_conns_of(self, client: SimClient) -> None:
        """A killed process's kernel resets its connections (the server sees each close)."""
        for conn, _ in list(self.server.conns.values()):
            if conn.client is client.proc:
                conn.client_open = True
                conn.close_by_client(reset=True)

    def restart_client(self, client: SimClient) -> None:
        client.proc.start()
        self.loop.note(f"{client.name} restarted")
        client.start()

    def restart_server(self) -> None:
        """The server process is killed and started again a moment later: from its journal, or
        without one (``--fence-state-file`` only) after a grace of the longest lease."""
        loop = self.loop
        loop.note("nemesis: server killed")
        self.verdict.cuts.append(Cut(loop.now, None))
        self.server.crash()
        self.server_proc.kill()
        down = loop.rng.uniform(0.1, 5.0)
        loop.later(down, self._server_back)

    def _server_back(self) -> None:
        self.server_proc.start()
        if self.mutation is None and self.loop.chance(0.3):
            self._reconfigure()
        # A grant restored from the journal counts against no address until it is reattached
        # (server/dflockd_server/shares.py): the cap's invariant counts the new run's grants.
        self.granted_to.clear()
        self.server = self._new_server()
        self.loop.note(f"server restarted (grace {self.server.grace_s:.2f} s)")

    def _reconfigure(self) -> None:
        """The operator restarts the server with other lease and session flags: a shorter
        ``--max-lease-ttl`` (one below ``MIN_SESSION_TTL_S``: no session a keep-alive can
        keep), ``--default-lease-ttl`` or ``--session-ttl`` (0: no sessions), or longer."""
        rng, config = self.loop.rng, self.config
        config.max_lease = rng.choice([60, 20, 6, 1])
        config.default_lease = min(rng.choice([12, 4, 2]), config.max_lease)
        config.session_ttl = rng.choice([c.DEFAULT_SESSION_TTL_S, 2, 10])
        self.loop.count("reconfigured")
        self.loop.note(
            f"nemesis: restarted with --max-lease-ttl {config.max_lease} --default-lease-ttl "
            f"{config.default_lease} --session-ttl {config.session_ttl}"
        )

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        loop = self.loop
        for client in self.clients:
            client.start()
        loop.later(loop.uniform(1.0, 5.0), self.nemesis)
        loop.later(0.1, self.audit)
        try:
            loop.run_until(self.duration)
        except Runaway as exc:
            self.verdict.violation(f"runaway: {exc}")
        finally:
            if self.server_proc.alive:
                self.server.crash()  # (its files closed)
            if self.machine.disk is not None:
                self.machine.disk.close()
        mutation = self.mutation
        return self.verdict.result(None if mutation is None else mutation.name, cluster=False)


DURATION_S = 300.0
"""Simulated seconds of a run of one server (by default)."""
CLUSTER_DURATION_S = 150.0
"""...and of a cluster's (its members' steps walk 8192 shards: a cluster's second costs more)."""


def simulate(
    seed: int,
    mutation: str | None = None,
    duration: float | None = None,
    *,
    control: bool = False,
    cluster: bool = False,
) -> Result:
    """Run seed ``seed`` (with the test-only switch ``mutation`` on; ``control``: in its
    scenario, the switch off) for ``duration`` simulated seconds (``DURATION_S``,
    ``CLUSTER_DURATION_S``), of one server or (``cluster``, or a cluster's mutation) of a
    cluster (``cluster.ClusterRun``). The product's log lines are off meanwhile (a run makes
    thousands)."""
    loggers = [logging.getLogger(name) for name in ("celery_dflock.client", "dflockd_server")]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        chosen = None if mutation is None else MUTATIONS[mutation]
        if cluster or (chosen is not None and chosen.cluster):
            seconds = CLUSTER_DURATION_S if duration is None else duration
            return ClusterRun(seed, chosen, seconds, control=control).run()
        return Run(
            seed, chosen, DURATION_S if duration is None else duration, control=control
        ).run()
    finally:
        for logger, was in zip(loggers, before, strict=True):
            logger.disabled = was
