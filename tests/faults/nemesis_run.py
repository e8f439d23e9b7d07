"""The nemeses of issue 27 against a lock cluster started as users start it.

`NemesisRun` is a `ClusterLockRun` whose members are `DefaultMember`s: the installed
``dflockd`` with ``--host 127.0.0.1 --port P --cluster etcd://.../PREFIX --advertise
127.0.0.1:P`` and nothing else (every other setting as shipped: ``--cluster-lease-ttl`` 5 s,
``--max-lease-ttl`` 300 s, ``--shutdown-timeout`` 30 s, the lease journal in the default state
directory ``$XDG_STATE_HOME/dflockd/HOST-PORT``, where the run's directory stands in for the
user's home). The clients use 3 s leases (`CLIENT_LEASE_S`).

Faults it adds to `ClusterLockRun`'s: a member paused (SIGSTOP) and resumed, a member whose
etcd connection goes through a `FaultProxy` the test stalls (clients still reach the member),
a member restarted in place (same port, ``--advertise`` and state directory), a second
process with a member's ``--advertise``, etcd killed (SIGKILL) or paused. `aim` starts workers
that lock one key only: a holder the test asks for a long hold, and waiters queued behind it on
the member the fault strikes. `served_by_other` waits, on etcd's map, for a key's shard to pass
to another member; `first_grants_after` reads the availability gap off the history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from dflockd_server.cluster.membership import read_view
from dflockd_server.cluster.shardmap import shard_id
from tests.faults.cluster_run import ClusterLockRun
from tests.faults.conftest import FaultReport, scaled
from tests.faults.history import Hold
from tests.faults.workload import (
    ACQUIRE_TIMEOUT_S,
    EVENT_TIMEOUT_S,
    POLL_S,
    Injection,
    LockServer,
    RunResult,
    Worker,
    holds_from_events,
    now,
    read_events,
)
from tests.support.etcd import OBSERVER_TIMEOUT_S, EtcdServer, find_etcd
from tests.support.processes import stop_process
from tests.support.proxy import FaultProxy
from tests.support.servers import DflockdProcess, run_dflockd
from tests.support.wire import Wire, holders_and_waiters

CLIENT_LEASE_S = 3
"""Every client's lease (acceptance 2 of issue 27: clients that use 3 s leases)."""
DEFAULT_CLUSTER_LEASE_S = 5
"""``--cluster-lease-ttl``'s default: a dead or cut-off member is noticed within about this."""
FAILOVER_MARGIN_S = 1.0
"""What a member adds to the dead member's published longest lease before a failover
(``dflockd_server.cluster.node.FAILOVER_MARGIN_S``; repeated here for the bounds' comments)."""
DRAIN_TIMEOUT_S = 45.0
"""How long a SIGTERMed member may take to exit: ``--shutdown-timeout``'s default 30 s, the
graceful leave's etcd writes, and a loaded machine's slack."""
PROBE_TIMEOUT_S = 5.0
MEMBER_LOG_TAIL = 60
"""How many of each member's last log lines a failed run prints."""
TAKEOVER_TIMEOUT_S = 60.0
"""How long the tests wait for a shard to pass to another member (not a bound: a deadline for
an event, generous for a loaded machine)."""


class DefaultMember(LockServer):
    """A cluster member started as users start it (see the module's docstring)."""

    def __init__(self, port: int, *, cluster_url: str, state_home: Path) -> None:
        super().__init__(port)
        self.cluster_url = cluster_url
        self.state_home = state_home
        self.logs: list[str] = []
        """The log lines of its earlier runs (each restart starts a new process)."""

    def start(self) -> None:
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--cluster",
            self.cluster_url,
            "--advertise",
            self.advertise,
        ]
        self.started += 1
        self.proc = DflockdProcess(args, {"XDG_STATE_HOME": str(self.state_home)})
        host, port = self.proc.wait_listening()
        assert (host, port) == self.address, (host, port)

    def kill(self) -> None:
        proc = self.proc
        super().kill()
        if proc is not None:
            self.logs += proc.drain()

    def terminate(self) -> None:
        """SIGTERM, as a service manager stops it; wait until it has drained and exited
        (exit code 0)."""
        proc, self.proc = self.proc, None
        assert proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.wait_exit(DRAIN_TIMEOUT_S)
        self.logs += proc.lines
        assert code == 0, (code, proc.lines[-20:])
        proc.kill()

    def pause(self) -> None:
        assert self.proc is not None
        stop_process(self.proc.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.proc.send_signal(signal.SIGCONT)


class NemesisEtcd(EtcdServer):
    """`EtcdServer` that can also be killed (SIGKILL) and paused (SIGSTOP / SIGCONT)."""

    def signal(self, signum: int) -> None:
        process = self._process
        assert process is not None and process.poll() is None, "etcd is not running"
        if signum == signal.SIGSTOP:
            stop_process(process.pid)
        else:
            process.send_signal(signum)

    def kill(self) -> None:
        process, self._process = self._process, None
        assert process is not None
        process.kill()
        process.wait(EVENT_TIMEOUT_S)


def start_etcd(directory: Path) -> NemesisEtcd:
    binary = find_etcd()
    assert binary is not None, "no etcd binary"  # the fixture `private_etcd` skips before
    server = NemesisEtcd(binary, directory)
    server.start()
    return server


@dataclasses.dataclass(frozen=True)
class Gap:
    """How long keys of a faulted member went without a grant."""

    what: str
    keys: tuple[str, ...]
    from_t: float
    first_grants: dict[str, float | None]
    """Per key: the first grant asked for after ``from_t`` (None: never granted again)."""

    @property
    def worst_s(self) -> float | None:
        """The longest gap over the keys (None if a key was never granted again)."""
        if not self.first_grants or any(t is None for t in self.first_grants.values()):
            return None
        return max(t for t in self.first_grants.values() if t is not None) - self.from_t

    def describe(self) -> str:
        worst = self.worst_s
        told = "never granted again" if worst is None else f"{worst:.1f} s"
        return f"{self.what}: its {len(self.keys)} keys unavailable for {told}"


class NemesisRun(ClusterLockRun):
    """See the module's docstring."""

    def __init__(
        self,
        directory: Path,
        *,
        etcd: EtcdServer,
        members: int = 3,
        spares: int = 0,
        workers: int = 3,
        keys: tuple[str, ...] = tuple(f"k{i}" for i in range(24)),
        seed: int = 0,
        etcd_proxies: bool = False,
    ) -> None:
        super().__init__(
            directory,
            mode="cluster",
            etcd=etcd,
            members=members,
            spares=spares,
            workers=workers,
            keys=keys,
            seed=seed,
        )
        self.lease_s = CLIENT_LEASE_S
        self.state_home = directory / "state-home"
        self.etcd_proxies: dict[str, FaultProxy] = {}
        defaults: list[LockServer] = []
        for old in self.members:
            url = self.cluster_url
            if etcd_proxies:
                proxy = FaultProxy(("127.0.0.1", etcd.client_port)).start()
                self.etcd_proxies[old.advertise] = proxy
                url = f"etcd://127.0.0.1:{proxy.address[1]}{self.prefix}"
            defaults.append(DefaultMember(old.port, cluster_url=url, state_home=self.state_home))
        self.members = defaults
        self.server = self.members[0]
        self.gaps: list[Gap] = []
        self._aimed = 0

    def member(self, advertise: str) -> DefaultMember:
        found = next(m for m in self.members if m.advertise == advertise)
        assert isinstance(found, DefaultMember)
        return found

    def close(self) -> None:
        try:
            super().close()
        finally:
            for proxy in self.etcd_proxies.values():
                proxy.stop()

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None:
            self.print_member_logs()
        super().__exit__(*exc_info)

    def print_member_logs(self, tail: int = MEMBER_LOG_TAIL) -> None:
        """Each member's last ``tail`` log lines, earlier runs included (pytest shows them with
        a failure: what the members did while the test waited)."""
        for member in self.members:
            if not isinstance(member, DefaultMember):
                continue
            lines = member.logs + (member.proc.drain() if member.proc is not None else [])
            print(f"--- {member.advertise}: the last {tail} of {len(lines)} log lines ---")
            for line in lines[-tail:]:
                print(line.rstrip())

    # ------------------------------------------------------------------ the map, from etcd
    def etcd_owner(self, key: str) -> tuple[str, str]:
        """(current, target) of ``key``'s shard in etcd's map."""
        assert self.etcd is not None
        shard_map = read_view(self.etcd.client(OBSERVER_TIMEOUT_S), self.prefix).shard_map
        assignment = shard_map[shard_id(key)]
        return assignment.current, assignment.target

    def keys_of(self, member: LockServer) -> tuple[str, ...]:
        """The run's keys whose shard ``member`` is the current node of, in etcd's map."""
        assert self.etcd is not None
        shard_map = read_view(self.etcd.client(OBSERVER_TIMEOUT_S), self.prefix).shard_map
        return tuple(k for k in self.keys if shard_map[shard_id(k)].current == member.advertise)

    def victim(self) -> DefaultMember:
        """A running member that is not the leader and serves some of the run's keys.

        Waits for one (up to `TAKEOVER_TIMEOUT_S`): members that join after the first own no
        shard until the leader's rebalance has moved some to them, which on a loaded machine
        may come after the run's first grants."""
        found: list[DefaultMember] = []

        def one_serves() -> bool:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                leader = self.leader()
                for member in self.members:
                    if member.running and member is not leader and self.keys_of(member):
                        assert isinstance(member, DefaultMember)
                        found.append(member)
                        return True
            return False

        wait_for(one_serves, "a running non-leader member serving a key of the run")
        return found[0]

    def wait_owner(
        self,
        key: str,
        ok: Callable[[str, str], bool],
        what: str,
        timeout: float = TAKEOVER_TIMEOUT_S,
    ) -> tuple[str, str]:
        """Poll etcd's map until ``ok(current, target)`` holds for ``key``'s shard."""
        deadline = now() + timeout
        last: tuple[str, str] = ("", "")
        while True:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                last = self.etcd_owner(key)
                if ok(*last):
                    return last
            assert now() < deadline, f"{what}: not after {timeout} s (current, target: {last})"
            time.sleep(POLL_S * 10)

    # ------------------------------------------------------------------ aimed workers
    def aim(
        self,
        key: str,
        n: int,
        *,
        seeds: list[LockServer] | None = None,
        lease_s: int | None = None,
        acquire_timeout_s: int = ACQUIRE_TIMEOUT_S,
    ) -> list[Worker]:
        """``n`` workers (every other one two-phase) that lock ``key`` only: a holder the test
        asks for a long hold and waiters queued behind it, or contenders for the key (with
        ``seeds``: the members their client starts from, instead of the run's; ``lease_s``:
        their lease, instead of the run's; ``acquire_timeout_s``: how long each acquire
        waits)."""
        made: list[Worker] = []
        for i in range(n):
            self._aimed += 1
            name = f"a{self._aimed}"
            cfg = self._config(
                name,
                self.server.address,
                keys=[key],
                db=str(self.db_path),
                fenced=self.fenced,
                two_phase=i % 2 == 1,
                lease_s=self.lease_s if lease_s is None else lease_s,
                acquire_timeout_s=acquire_timeout_s,
                seed=self.rng.randrange(2**31),
            )
            if seeds is not None:
                cfg = dataclasses.replace(
                    cfg,
                    host=seeds[0].address[0],
                    port=seeds[0].port,
                    servers=tuple(m.address for m in seeds),
                )
            worker = Worker(cfg)
            self.workers[name] = worker
            made.append(worker)
        for worker in made:
            worker.wait_ready()
        return made

    def hold_long(self, worker: Worker, seconds: float) -> dict[str, object]:
        """Have ``worker`` hold its next grant for ``seconds``; its ``long`` event."""
        worker.request_long_hold(seconds)
        return worker.wait_event("long", timeout=TAKEOVER_TIMEOUT_S)

    # ------------------------------------------------------------------ faults
    def pause_member(self, member: DefaultMember) -> None:
        member.pause()
        self.injections.append(Injection(f"member {member.advertise} SIGSTOP", now()))

    def resume_member(self, member: DefaultMember) -> None:
        member.resume()
        self.injections.append(Injection(f"member {member.advertise} SIGCONT", now()))

    def cut_from_etcd(self, member: DefaultMember) -> None:
        """Stall everything between ``member`` and etcd (its clients still reach it)."""
        self.etcd_proxies[member.advertise].stall(3600)
        self.injections.append(Injection(f"member {member.advertise} cut from etcd", now()))

    def reconnect_to_etcd(self, member: DefaultMember) -> None:
        self.etcd_proxies[member.advertise].resume()
        self.injections.append(Injection(f"member {member.advertise} reaches etcd again", now()))

    def restart_in_place(self, member: DefaultMember, *, how: str) -> None:
        """SIGKILL (``how="kill"``) or SIGTERM (``"term"``: it drains and leaves) the member,
        then start it again with the same port, ``--advertise`` and state directory."""
        t = now()
        if how == "kill":
            member.kill()
        else:
            member.terminate()
        self.injections.append(Injection(f"member {member.advertise} {how} + restart", t))
        member.start()

    def remove_member(self, member: LockServer) -> None:
        """A graceful leave: SIGTERM, and the member drains, leaves and exits with 0 (within
        the default --shutdown-timeout)."""
        assert isinstance(member, DefaultMember)
        t = now()
        member.terminate()
        self.injections.append(Injection(f"member {member.advertise} SIGTERM (leaves)", t))

    def pin(self, key: str, node: str) -> None:
        """``dflockd pin --cluster URL SHARD NODE``, as an operator does (again while the
        leader's own write of the map conflicts with it)."""
        deadline = now() + TAKEOVER_TIMEOUT_S
        while True:
            done = run_dflockd(
                ["pin", "--cluster", self.cluster_url, str(shard_id(key)), node],
                {},
                EVENT_TIMEOUT_S,
            )
            if done.returncode == 0:
                self.injections.append(Injection(f"shard of {key} pinned to {node}", now()))
                return
            assert now() < deadline, f"dflockd pin failed: {done.stdout}{done.stderr}"
            time.sleep(POLL_S * 10)

    def duplicate(self, member: DefaultMember) -> subprocess.CompletedProcess[str]:
        """A second ``dflockd`` with ``member``'s ``--advertise`` (its own port and state
        directory), run until it exits."""
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--cluster",
            member.cluster_url,
            "--advertise",
            member.advertise,
        ]
        env = {"XDG_STATE_HOME": str(self.directory / "duplicate-home")}
        self.injections.append(Injection(f"duplicate --advertise {member.advertise}", now()))
        return run_dflockd(args, env, TAKEOVER_TIMEOUT_S)

    def kill_etcd(self) -> None:
        etcd = self.etcd
        assert isinstance(etcd, NemesisEtcd)
        t = now()
        etcd.kill()
        self.injections.append(Injection("etcd SIGKILL", t))

    # ------------------------------------------------------------------ measuring
    def all_holds(self) -> list[Hold]:
        workers = self.all_workers()
        return [h for w in workers for h in holds_from_events(w.client, read_events(w.history))]

    def first_grants_after(
        self, keys: tuple[str, ...], t: float, *, grantees: set[str] | None = None
    ) -> dict[str, float | None]:
        """Per key: the first grant asked for after ``t`` (by ``grantees`` only, if given)."""
        holds = self.all_holds()
        return {
            key: min(
                (
                    h.granted_t
                    for h in holds
                    if h.key == key
                    and h.granted_t is not None
                    and h.requested_t > t
                    and (grantees is None or h.client in grantees)
                ),
                default=None,
            )
            for key in keys
        }

    def wait_granted_after(
        self,
        keys: tuple[str, ...],
        t: float,
        timeout: float = TAKEOVER_TIMEOUT_S,
        *,
        grantees: set[str] | None = None,
    ) -> dict[str, float | None]:
        """Until each of ``keys`` was granted to a request made after ``t`` (by one of
        ``grantees``, if given)."""
        deadline = now() + timeout
        while True:
            firsts = self.first_grants_after(keys, t, grantees=grantees)
            if all(v is not None for v in firsts.values()):
                return firsts
            missing = [k for k, v in firsts.items() if v is None]
            for worker in self.workers.values():
                assert worker.alive(), f"{worker.client} died: {worker.stderr()}"
            assert now() < deadline, f"{missing} not granted again {timeout} s after the fault"
            time.sleep(POLL_S * 10)

    def wait_served_elsewhere(
        self, keys: tuple[str, ...], gone: LockServer, t: float
    ) -> dict[str, float]:
        """Per key: when a member other than ``gone`` first answered a probe for it as its
        server, seconds after ``t``. The probe asks every other running member on a
        connection of its own, ``l KEY 0 1``: granted (released at once) or ``timeout``
        (someone holds it there) means served; ``error_moved`` or ``error_unavailable`` not
        yet. Probes are not in the history (a probe's grant is another client's)."""
        served: dict[str, float] = {}
        deadline = now() + TAKEOVER_TIMEOUT_S
        others = [m for m in self.members if m.running and m is not gone]
        with contextlib.ExitStack() as stack:
            wires = [stack.enter_context(Wire(m.address, timeout=PROBE_TIMEOUT_S)) for m in others]
            while len(served) < len(keys):
                for key in keys:
                    for wire in wires:
                        if key in served:
                            break
                        reply = wire.req("l", key, "0 1")
                        if reply.startswith("ok "):
                            assert wire.req("r", key, reply.split()[1]) == "ok"
                        if reply.startswith(("ok ", "timeout")):
                            served[key] = now() - t
                missing = set(keys) - set(served)
                assert now() < deadline, f"{missing} not served {TAKEOVER_TIMEOUT_S} s after"
                time.sleep(POLL_S * 5)
        return served

    def wait_back(self, member: LockServer, key: str) -> str:
        """Probe ``member`` (``l KEY 0 1``) until it answers for ``key`` as a member that is
        back in the cluster: ``timeout`` (held there: after a restart, a lease it restored),
        a grant (released at once), or ``error_moved`` (the shard is moving out of it: the
        leader retargeted it while the member was down). The reply."""
        deadline = now() + TAKEOVER_TIMEOUT_S
        while True:
            with (
                contextlib.suppress(OSError, AssertionError),
                Wire(member.address, timeout=PROBE_TIMEOUT_S) as wire,
            ):
                reply = wire.req("l", key, "0 1")
                if reply.startswith("ok "):
                    assert wire.req("r", key, reply.split()[1]) == "ok"
                if reply.startswith(("ok ", "timeout", "error_moved")):
                    return reply
            assert now() < deadline, f"{member.advertise} is not back for {key}"
            time.sleep(POLL_S * 10)

    def stop_servers(self) -> None:
        """SIGTERM every running member at once, then wait for each (a graceful leave each)."""
        for member in self.members:
            if member.proc is not None and member.proc.proc.poll() is None:
                member.proc.proc.send_signal(signal.SIGTERM)
        for member in self.members:
            proc, member.proc = member.proc, None
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait_exit(DRAIN_TIMEOUT_S)
                proc.kill()

    def longest_hold(self, worker: Worker) -> str:
        """How ``worker``'s longest hold ended, in words."""
        holds = [
            h
            for h in holds_from_events(worker.client, read_events(worker.history))
            if h.granted_t is not None and h.released_t is not None
        ]
        assert holds, f"{worker.client} held nothing to the end"
        hold = max(holds, key=lambda h: (h.released_t or 0) - (h.granted_t or 0))
        took = (hold.released_t or 0) - (hold.granted_t or 0)
        if hold.release_ok:
            return f"the {took:.1f} s hold (lease {hold.lease_s} s) was kept and released"
        told = "reported lost to its client" if hold.reported_lost else "lost, not reported"
        return f"the {took:.1f} s hold (lease {hold.lease_s} s) was {told}"

    def longest_pause(self, t0: float, t1: float) -> float:
        """The longest time within [t0, t1] in which no key at all was granted."""
        grants = [h.granted_t for h in self.all_holds() if h.granted_t is not None]
        edges = [t0, *sorted(g for g in grants if t0 < g < t1), t1]
        return max(b - a for a, b in itertools.pairwise(edges))

    def record_gap(self, what: str, keys: tuple[str, ...], t: float) -> Gap:
        gap = Gap(what, keys, t, self.wait_granted_after(keys, t))
        self.gaps.append(gap)
        print(gap.describe())
        return gap


# ---------------------------------------------------------------------- the tests' shared parts
PROGRESS_S = scaled(1, 5)
"""Load between two faults."""
PROGRESS_GRANTS = scaled(20, 200)
KILL9_TAKEOVER_BOUND_S = 15.0
"""Acceptance 2 of issue 27: a killed member's keys are served by another member within this."""
LONG_HOLD_S = 9.0
"""The aimed holder's long hold: longer than its lease (renewed meanwhile) and than a restart."""
HOLDER_LEASE_S = 10
"""The restarted member's aimed holder's lease: it outlives the restart (the new process waits
up to --cluster-lease-ttl for its previous registration to go), so the restarted member
restores a lease that is still held when its shard moves."""
WAITER_HOLD_S = float(CLIENT_LEASE_S)
"""What a queued waiter holds once granted: a fenced member that granted it would be seen
overlapping the heir's grants for that long."""
ETCD_DOWN_S = DEFAULT_CLUSTER_LEASE_S + 2.0
"""How long etcd stays killed or paused: past every member's etcd lease, so all fence."""


def checked(result: RunResult) -> str:
    """Assert the history's promises; the summary's first line."""
    check = result.check()
    assert check.ok, check.summary()
    assert check.proven >= 0.9 * check.holds, check.summary()  # rule (a) is not vacuous
    assert check.ordered_pairs > 0, check.summary()
    assert result.lost_updates == 0, result.resource
    assert result.stale_accepted == 0, result.resource
    return check.summary().splitlines()[0]


def report(
    fault_report: FaultReport, result: RunResult, fault: str, gaps: list[Gap], extra: str = ""
) -> None:
    check = result.check()
    worst = [g.worst_s for g in gaps if g.worst_s is not None]
    row = result.row(
        fault,
        check,
        "; ".join([*(g.describe() for g in gaps), *([extra] if extra else []), checked(result)]),
    )
    fault_report.add(dataclasses.replace(row, recovery_s=max(worst, default=None)))


def queue_behind_a_long_hold(run: NemesisRun, member: DefaultMember, key: str) -> None:
    """A holder holds ``key`` long on ``member``, and waiters are queued behind it there,
    waiting up to `TAKEOVER_TIMEOUT_S` (so that they are still queued when a fault that
    outlasts an ordinary acquire timeout ends); each will hold for `WAITER_HOLD_S` once
    granted, by whichever member."""
    (holder,) = run.aim(key, 1)
    run.wait_progress(PROGRESS_S / 2, 1)
    run.hold_long(holder, LONG_HOLD_S)
    waiters = run.aim(key, 2, acquire_timeout_s=int(TAKEOVER_TIMEOUT_S))
    for waiter in waiters:  # asked now: the key is held, so no grant before the fault uses it
        waiter.request_long_hold(WAITER_HOLD_S)
    deadline = now() + TAKEOVER_TIMEOUT_S
    while holders_and_waiters(member.address, key)[1] < len(waiters):
        assert now() < deadline, f"the waiters did not queue on {key} at {member.advertise}"
        time.sleep(0.02)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = now() + TAKEOVER_TIMEOUT_S
    while not condition():
        assert now() < deadline, f"{what}: not after {TAKEOVER_TIMEOUT_S} s"
        time.sleep(0.1)
