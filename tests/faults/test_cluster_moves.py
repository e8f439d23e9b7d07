"""The nemeses of issue 48: key-level moves (a shard split from its current member A towards
B, ``error_ask`` with A's ticket, ``asking`` at B) under faults, with the history checker.

The run's keys include a group of keys of one shard. A holder holds one of them long at A; the
shard is pinned to B, so A splits it: the group's other keys are asked for at B by the workload's
clients (the ticket passed along) while the held one stays at A, two waiters queued behind it
there (each holds it for a while once granted, by A, in order). Then a fault:

- ``kill_exporter``: A is killed (SIGKILL) and stays down: B takes the shard after A's longest
  lease, its fence raised above A's ceiling;
- ``kill_importer``: B is killed and restarted in place: A keeps the split (B may hold keys it
  was asked for) until B is back;
- ``restart_exporter``: A is killed and restarted in place on its state directory: it restores
  the held key, asks for the others at B again, its counter seeded again from the clock;
- ``counter_jump``: one of B's shards is pinned to A, which raises its counter above B's ceiling
  when it takes it: the waiters A grants the held key to afterwards have fences above B's
  counter, and B, granting the key after them (asked, or the shard handed over), must grant
  above them (before issue 48 it granted below: a fence-order violation);
- ``rogue``: a raw client sends B ``asking`` without a ticket, with a made-up one and with A's
  ticket for another key, each followed by an acquire of the key held at A, over and over:
  every one must be refused (before issue 48, B granted it: a double grant).

Each run must show no double grant, fences in grant order per key whichever member granted,
no lost or stale update of the fenced counter (so no current holder refused by the fenced
store). The report rows are in tests/faults/README.md.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dflockd_server.cluster.membership import read_view
from dflockd_server.cluster.shardmap import ShardAssignment, shard_id
from tests.faults.conftest import FaultReport, long_only
from tests.faults.nemesis_run import (
    HOLDER_LEASE_S,
    LONG_HOLD_S,
    PROGRESS_GRANTS,
    PROGRESS_S,
    TAKEOVER_TIMEOUT_S,
    WAITER_HOLD_S,
    DefaultMember,
    NemesisEtcd,
    NemesisRun,
    report,
    wait_for,
)
from tests.faults.workload import Injection, now
from tests.support.etcd import OBSERVER_TIMEOUT_S
from tests.support.wire import Wire, holders_and_waiters

pytestmark = pytest.mark.timeout(300)
"""A nemesis run takes 20-60 s on a loaded 2-core machine (a kill waits a failover)."""

GROUP = 5
"""Keys of the moving shard in the run."""


def one_shard_keys(count: int) -> tuple[str, ...]:
    """``count`` keys that share a shard (the first shard that many ``mv<N>`` keys fall in)."""
    by_shard: dict[int, list[str]] = {}
    i = 0
    while True:
        key = f"mv{i}"
        keys = by_shard.setdefault(shard_id(key), [])
        keys.append(key)
        if len(keys) == count:
            return tuple(keys)
        i += 1


def assignment_of(run: NemesisRun, key: str) -> ShardAssignment:
    """``key``'s shard's assignment in etcd's map."""
    assert run.etcd is not None
    return read_view(run.etcd.client(OBSERVER_TIMEOUT_S), run.prefix).shard_map[shard_id(key)]


def balanced(run: NemesisRun) -> bool:
    """Whether etcd's map has every running member the target of its share of the shards
    (within one), no shard moving and none split."""
    assert run.etcd is not None
    shard_map = read_view(run.etcd.client(OBSERVER_TIMEOUT_S), run.prefix).shard_map
    counts = shard_map.counts()
    running = {m.advertise for m in run.members if m.running}
    return (
        set(counts) == running
        and max(counts.values()) - min(counts.values()) <= 1
        and not shard_map.moves_in_progress()
        and not any(a.split for _, a in shard_map.items())
    )


def split_towards(run: NemesisRun, key: str) -> str:
    """The split's node of ``key``'s shard in etcd's map ("" when not split)."""
    return assignment_of(run, key).split


class Rogue:
    """A raw client that tries to be granted ``held`` at ``importer`` without a genuine ticket
    for it (see the module's docstring), until stopped; what it was answered."""

    def __init__(self, importer: DefaultMember, exporter: DefaultMember, held: str, free: str):
        self.importer, self.exporter, self.held, self.free = importer, exporter, held, free
        self.granted: list[str] = []
        self.admitted = 0
        self.tries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rogue asking", daemon=True)

    def start(self) -> Rogue:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TAKEOVER_TIMEOUT_S)

    def _free_ticket(self) -> str:
        """A's genuine ticket for another key of the shard (``_`` when A gives none now)."""
        try:
            with Wire(self.exporter.address, timeout=5) as w:
                reply = w.req("l", self.free, "0 1").split()
        except OSError:
            return "_"
        if reply[0] == "ok":
            return "_"  # the shard is whole again somewhere: nothing to steal a ticket from
        return reply[2] if reply[0] == "error_ask" and len(reply) == 3 else "_"

    def _run(self) -> None:
        while not self._stop.is_set():
            genuine = self._free_ticket()
            forged = ["_", "0.0.0." + "0" * 32, genuine]
            if genuine.count(".") == 3:
                revision, expires, floor, mac = genuine.split(".")
                forged.append(f"{revision}.{expires}.{int(floor, 16) + 1:x}.{mac}")
            for ticket in forged:
                try:
                    with Wire(self.importer.address, timeout=5) as w:
                        self.tries += 1
                        if w.req("asking", self.held, ticket) == "ok":
                            self.admitted += 1
                        reply = w.req("l", self.held, "0 1")
                except OSError:
                    continue
                if reply.startswith("ok "):
                    self.granted.append(reply)
            self._stop.wait(0.05)


SIMULATED = long_only(
    "the simulator's cluster seeds carry it (tests/sim: forged asking, restarts, kills); "
    "CI runs the kill_exporter run on real processes"
)


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param("rogue", marks=SIMULATED),
        pytest.param("counter_jump", marks=SIMULATED),
        "kill_exporter",
        pytest.param("kill_importer", marks=SIMULATED),
        pytest.param("restart_exporter", marks=SIMULATED),
    ],
)
def test_a_key_level_move_under_a_fault_grants_each_key_once_with_rising_fences(
    tmp_path: Path, fault_report: FaultReport, nemesis_etcd: NemesisEtcd, fault: str
) -> None:
    group = one_shard_keys(GROUP)
    keys = (*group, *(f"k{i}" for i in range(12)))
    with NemesisRun(tmp_path, etcd=nemesis_etcd, seed=4800, keys=keys) as run:
        run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
        # The run starts once the map names every member, which may be before the leader's
        # first rebalance onto the last one to join: the group's shard may still be split
        # towards it (the workload keeps its keys busy), and a pin to another member leaves
        # that split as it is. CI saw the test pin such a shard and wait for a split that
        # could not come.
        wait_for(lambda: balanced(run), "the map balanced over the members, nothing moving")
        held, free = group[0], group[1]
        exporter = run.member(run.etcd_owner(held)[0])
        importer = next(m for m in run.members if m.running and m is not exporter)
        assert isinstance(importer, DefaultMember)
        (holder,) = run.aim(held, 1, lease_s=HOLDER_LEASE_S)
        run.wait_progress(PROGRESS_S / 2, 1)
        run.hold_long(holder, LONG_HOLD_S)
        hold_began = now()
        waiters = run.aim(held, 2, acquire_timeout_s=int(TAKEOVER_TIMEOUT_S))
        for waiter in waiters:
            waiter.request_long_hold(WAITER_HOLD_S)
        t = now()
        run.pin(held, importer.advertise)
        # (A shard with nothing held or queued at the exporter when it reads the pin is handed
        # over whole, never split: the message says how far into the long hold the pin came.)
        try:
            wait_for(
                lambda: split_towards(run, held) == importer.advertise,
                f"the shard split (pinned {t - hold_began:.1f} s into the {LONG_HOLD_S:.0f} s "
                f"hold, from {exporter.advertise} to {importer.advertise})",
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; in etcd: {assignment_of(run, held)}; the holders and waiters of "
                f"{held} at the exporter: {holders_and_waiters(exporter.address, held)}"
            ) from None
        # The workload's clients follow A's asks: the group's free keys granted at B.
        run.wait_granted_after(group[1:], t)
        rogue: Rogue | None = None
        if fault == "rogue":
            rogue = Rogue(importer, exporter, held, free).start()
            time.sleep(LONG_HOLD_S / 2)
            rogue.stop()
        elif fault == "counter_jump":
            jumped = next(k for k in run.keys_of(importer) if k not in group)
            run.pin(jumped, exporter.advertise)
            run.wait_owner(jumped, lambda current, _: current == exporter.advertise, "taken")
        elif fault == "kill_exporter":
            run.kill_member(exporter, "exporting member")
        elif fault == "kill_importer":
            run.kill_member(importer, "importing member")
            time.sleep(PROGRESS_S)
            importer.start()
            run.injections.append(Injection(f"member {importer.advertise} restarted", now()))
        else:
            run.restart_in_place(exporter, how="kill")
        after = now()
        gap = run.record_gap(f"key-level move + {fault}", group, after)
        run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
        run.settle(TAKEOVER_TIMEOUT_S)
        result = run.finish()
    extra = f"shard of {held} split from {exporter.advertise} to {importer.advertise}"
    if rogue is not None:
        assert rogue.tries > 0
        assert rogue.admitted == 0 and rogue.granted == [], (rogue.admitted, rogue.granted)
        extra += f"; {rogue.tries} rogue asking + acquire of the held key: all refused"
    report(
        fault_report,
        result,
        f"lock cluster (defaults): a key-level move (one key held long at the old member, "
        f"the shard pinned to another) + {fault.replace('_', ' ')}",
        [gap],
        extra,
    )
