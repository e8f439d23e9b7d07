"""Historical defects, each put back behind a test-only switch of the simulator.

Each switch is the simulator's own: a subclass of a product class that the simulated server
uses instead (``server.Mutations``), or a setting of the simulator's own parts. The product code
has no switch: a run without a mutation runs the product's classes as they are. Each is found
by the simulator within a few seeds (tests/sim/test_simulation.py). A cluster's defect
(``cluster=True``) runs cluster seeds (``cluster.ClusterRun``); its switch is a subclass a
restarted member uses (``fence_counter``, ``ceiling_store``) or the simulated server's
(``asking_without_ticket``: ``SimServer.admit_ask`` admits what the snapshot would refuse).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflockd_server.cluster.fencestore import EtcdCeilingStore
from dflockd_server.journal import Journal, RecordedGrant
from dflockd_server.keys import Client, Holder
from dflockd_server.replay import JournalRead, Restore, restored_leases
from dflockd_server.shares import AddressShares
from dflockd_server.table import LockTable
from dflockd_server.tokens import FenceCounter

if TYPE_CHECKING:
    from tests.sim.server import Mutations, ServerConfig

__all__ = ["MUTATIONS", "Mutation"]


@dataclass(frozen=True)
class Mutation:
    name: str
    defect: str
    """The defect it puts back, in a line."""
    switch: Callable[[Mutations], None]
    """Turns the defect on (the server's parts the simulator uses)."""
    scenario: Callable[[ServerConfig], None] | None = None
    """The server's settings the defect shows under (kept in a control run, without it)."""
    faults: tuple[str, ...] | None = None
    """The faults of its runs (None: every fault): a defect some fault hides is shown with
    the others only."""
    cluster: bool = False
    """Its runs are a cluster's (``cluster.ClusterRun``)."""


class _CloseFreesSessionAtOnce(LockTable):
    """A close by the peer frees a session connection's grants at once (its client, which
    counts on its session's time, still believes it holds them)."""

    def disconnect(self, client: Client, *, by_peer: bool = True) -> None:
        kept = client.kept_by
        if by_peer and kept is not None:
            kept.clients.remove(client)
            client.kept_by = None
        client.session = False
        super().disconnect(client, by_peer=by_peer)


class _DetachedNotCapped(AddressShares):
    """A detached hold does not count against its address's ``--max-locks-per-ip``."""

    def granted(self, holder: Holder, taker: Client) -> None:
        if holder.client is taker:
            super().granted(holder, taker)


class _CompactionFailureUnseen(Journal):
    """A compaction whose directory fsync fails after its rename leaves the writer on the old
    file (renamed over: no longer the journal) and the journal writable: what is granted then
    is acknowledged from records no restart reads."""

    def compact(self, live: Iterable[bytes]) -> None:
        fd = self._fd  # pyright: ignore[reportPrivateUsage]
        old = os.dup(fd) if fd >= 0 else -1
        super().compact(live)
        if self.writable or old < 0:
            if old >= 0:
                os.close(old)
            return
        new, self._fd = self._fd, old  # pyright: ignore[reportPrivateUsage]
        os.close(new)
        self.writable = True
        self.failure = ""
        self.refused.clear()
        os.close(os.open(self.mark_path, os.O_WRONLY | os.O_CREAT, 0o600))


def _restored_by_wall_clock(
    read: JournalRead,
    wall_ms: int,
    complete: bool = True,
    run_longest: int = 0,
    tail_lost: str = "",
    monotonic_ms: int | None = None,
    this_boot: str | None = None,
) -> Restore:
    """``replay.restored_leases``, but across a boot each lease runs to its recorded end on
    the wall clock (trusted), and no grace: a reboot whose clock stepped forward finds every
    lease over and restores none."""
    restore = restored_leases(
        read,
        complete=complete,
        run_longest=run_longest,
        tail_lost=tail_lost,
        monotonic_ms=monotonic_ms,
        this_boot=this_boot,
    )
    if restore.exact:
        return restore
    kept: list[RecordedGrant] = []
    for rec in restore.leases:
        left = (rec.until_ms - wall_ms) / 1000.0
        if left > 0:
            rec.left = min(left, float(rec.lease_ttl))
            kept.append(rec)
    return Restore(kept, "another boot, by the wall clock", 0.0)


class _CeilingForgotten(EtcdCeilingStore):
    """A restarted cluster member reads no ceiling of its own from etcd."""

    def read(self) -> int:
        return 0


class _WallClockCounter(FenceCounter):
    """A restarted cluster member's counter trusts its wall clock alone: it is raised to no
    ceiling another member published and to no ask ticket's floor."""

    __slots__ = ()

    def raise_to(self, floor: int) -> None:
        return

    def raise_within(self, floor: int) -> bool:
        return True


def _member_fence_reseeded(m: Mutations) -> None:
    m.ceiling_store = _CeilingForgotten
    m.fence_counter = _WallClockCounter


def _asking_without_ticket(m: Mutations) -> None:
    m.asking_without_ticket = True


def _close_frees_session(m: Mutations) -> None:
    m.table = _CloseFreesSessionAtOnce


def _read_timeout_frees(m: Mutations) -> None:
    m.read_timeout_by_peer = True


def _without_sessions(config: ServerConfig) -> None:
    # Only a connection no client session keeps is closed for being idle: a server without
    # sessions (``--session-ttl 0``), whose clients pause (a reset or a partition there frees
    # a connection's grants at once by design: see docs/protocol.md).
    config.session_ttl = 0
    config.read_timeout = 8.0


def _detached_not_capped(m: Mutations) -> None:
    m.shares = _DetachedNotCapped


def _capped(config: ServerConfig) -> None:
    config.locks_per_ip = 2


def _reboot_by_wall_clock(m: Mutations) -> None:
    m.restored_leases = _restored_by_wall_clock


def _with_journal(config: ServerConfig) -> None:
    config.journal_fsync = "always"


def _compaction_failure_unseen(m: Mutations) -> None:
    m.journal = _CompactionFailureUnseen


def _fence_reseeded(m: Mutations) -> None:
    m.fence_from_wall_clock = True


MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in (
        Mutation(
            "close-frees-session",
            "a close by the peer frees a session's grants at once while its client believes",
            _close_frees_session,
        ),
        Mutation(
            "read-timeout-frees",
            "the server's read timeout frees the grants of the connection it closes",
            _read_timeout_frees,
            _without_sessions,
            ("pause", "quiet"),
        ),
        Mutation(
            "detached-not-capped",
            "detached grants are not counted by --max-locks-per-ip",
            _detached_not_capped,
            _capped,
        ),
        Mutation(
            "reboot-restores-by-wall-clock",
            "a start after a reboot restores each lease to its recorded end on the wall clock "
            "(stepped forward: none) and waits no grace",
            _reboot_by_wall_clock,
            _with_journal,
        ),
        Mutation(
            "compaction-failure-unseen",
            "a compaction whose directory fsync fails after the rename leaves the writer on the "
            "old file and grants on: acknowledged grants no restart reads",
            _compaction_failure_unseen,
            _with_journal,
        ),
        Mutation(
            "fence-from-wall-clock",
            "a restarted server's fence counter is seeded from the wall clock alone (its "
            "stored ceiling ignored), after a reboot that stepped the clock back",
            _fence_reseeded,
        ),
        Mutation(
            "asking-without-ticket",
            "a cluster member admits an asking for a key of a shard split to it without a "
            "valid ticket (for another key, an earlier split), and without raising its fence "
            "above the ticket's",
            _asking_without_ticket,
            faults=("member_join", "member_join", "member_leave", "quiet", "quiet", "quiet"),
            cluster=True,
        ),
        Mutation(
            "member-fence-from-wall-clock",
            "a restarted cluster member's fence counter is seeded from its wall clock alone "
            "(the ceilings in etcd and the ask tickets' floors ignored), after a reboot that "
            "stepped the clock back",
            _member_fence_reseeded,
            cluster=True,
        ),
    )
}
