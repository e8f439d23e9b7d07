"""How a cluster member moves shards (``Handover``): hands them over, takes them after a
failover, releases them when it leaves. ``ClusterNode`` (``node``) decides when; every write
here is conditioned on the shard's revision and on this member's lease (``mapwrite``).

Handover, key by key (``decide``; docs/protocol.md *Key-level moves*): while a key of a shard
moving out is held or queued here, the member publishes its fence ceiling, then writes
``split=<target>`` (the other keys are asked for there); once ``NodeHost.holders_in`` shows
nothing held or queued, it publishes the ceiling and sets current = the split's node, dropping
the flag. A split towards a gone member is dropped after that member's longest lease
(``unsplit``). Failover: see ``decide``; the waits and the take-over are written here.

The failover bound. A member that dies or loses etcd grants and renews nothing after its last
successful keep-alive's sending time + ``lease_ttl_s``, no later than etcd expires its lease
(etcd counts from receipt, and may raise a short TTL to its minimum, about 2 s by default:
that only delays the expiry), when the others see it gone. Its holders' leases end within
the longest lease it granted or renewed: before granting or renewing a longer one than ever,
a member publishes the new bound (``<prefix>/longest/<member>``, no lease, so it outlives the
member; a failed write refuses the grant). The new owner waits that bound (``max_lease_ttl_s``
if none) + ``failover_margin_s`` from when it first saw the member gone, so it grants only
after every lease the dead member granted has ended (given clock rates that differ by less
than the margin over that time). A dead member's keys are thus unavailable for at most: the
etcd lease TTL (plus an election and the leader's map update, a few round trips) + the longest
lease its clients used + the margin + a tick (``NODE_TICK_S``): about one real lease, not the
longest any member could grant.

A graceful leave (``ClusterNode.stop(leave=True)``, after the server's drain) hands its shards
over instead of making the others wait. The node stops deciding and refuses every acquire;
for each shard it serves, it asks ``NodeHost.holders_in`` (on the loop: no grant can follow)
and leaves out the shards in ``keep`` (holders the shutdown timeout cut off may still believe
they hold: they get the failover wait). It publishes its fence ceiling, then writes the
others released (``ShardAssignment.release``: current empty, flag ``released``; on condition
of the shard's revision and its own lease), and only then revokes its lease. Each heir takes a
released shard at once and raises its fence above every published ceiling before granting:
a few etcd round trips, not the longest lease. Shards still held, kept or conflicted, and every
shard when the member cannot show its lease alive, are left to the failover wait.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence

from dflockd_server.cluster.decide import Decision, handover_due
from dflockd_server.cluster.etcd import Compare, EtcdClient
from dflockd_server.cluster.fencestore import published_longest
from dflockd_server.cluster.host import NodeHost
from dflockd_server.cluster.mapwrite import ShardWrite, write_shards
from dflockd_server.cluster.membership import ClusterView, Member
from dflockd_server.cluster.ops import read_view
from dflockd_server.cluster.shardmap import ShardAssignment
from dflockd_server.tokens import FenceCounter

log = logging.getLogger("dflockd_server")

__all__ = ["RELEASE_ATTEMPTS", "Handover"]

RELEASE_ATTEMPTS = 3
"""Attempts in all of a graceful leave's release (a write may conflict with the leader's)."""


class Handover:
    """One member's shard moves, called from its node's thread (``release``: once it stopped)."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        advertise: str,
        host: NodeHost,
        *,
        max_lease_ttl_s: float,
        failover_margin_s: float,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.advertise = advertise
        self.host = host
        self.max_lease_ttl_s = max_lease_ttl_s
        self.failover_margin_s = failover_margin_s
        self._written_from: dict[int, int] = {}
        self._split_gone_since: dict[int, float] = {}
        """Shards this member splits towards a node that is not live: since when (seen)."""
        self._split_waits: dict[str, float] = {}
        """Nodes not live that this member's shards are split towards: the wait read for each."""
        self._waits: dict[str, float | None] = {}
        """Gone members whose shards this one waits to take: the wait read for each (None: it
        published none)."""
        # Counters (the node's thread adds; a scrape reads).
        self.handovers = 0
        self.failovers = 0
        self.released_takeovers = 0

    def forget(self) -> None:
        """Forget what was seen and written (fenced: a rejoin starts afresh)."""
        self._split_gone_since = {}
        self._split_waits = {}
        self._written_from = {}
        self._waits = {}

    def failover_waits(self, view: ClusterView, *, fresh: bool = False) -> dict[str, float] | None:
        """Per gone member whose shards this one waits to take: its published longest lease
        plus the margin. Read from etcd when a member joins the waits (a gone member publishes
        no longer lease that counts) and when ``fresh`` (before a failover is carried out), not
        at each decision: etcd news (batched targets, others' failovers) brings many."""
        me, live = self.advertise, view.members
        gone = {
            a.current
            for _, a in view.shard_map.items()
            if a.target == me and a.current and a.current not in live and not a.released
        }
        if not gone:
            self._waits = {}
            return None
        if fresh or not gone <= self._waits.keys():
            published = published_longest(self.client, self.prefix)
            margin = self.failover_margin_s
            self._waits = {m: (published[m] + margin if m in published else None) for m in gone}
        else:
            self._waits = {m: self._waits[m] for m in gone}
        return {m: w for m, w in self._waits.items() if w is not None}

    def take_over(
        self,
        view: ClusterView,
        member: Member,
        shards: Collection[int],
        gone_at: Mapping[str, int],
    ) -> set[str]:
        """Set current = this member for shards whose failover is due, on condition that their
        gone member has not registered since ``gone_at`` (the revision of the view that first
        showed it gone; ``_write_while_gone``). Returns the gone members whose writes that
        refused: their waits start again."""
        shard_map = view.shard_map
        by_gone: dict[str, dict[int, ShardAssignment]] = {}
        for s in shards:
            by_gone.setdefault(shard_map[s].current, {})[s] = shard_map[s].served_by(self.advertise)
        written: set[int] = set()
        refused: set[str] = set()
        for gone, new in by_gone.items():
            done, failed = self._write_while_gone(view, member, gone, gone_at.get(gone, 0), new)
            written |= done
            if failed and gone:
                refused.add(gone)
        released = sum(shard_map[s].released for s in written)
        self.released_takeovers += released
        self.failovers += len(written) - released
        return refused

    def move_out(
        self, view: ClusterView, member: Member, decision: Decision, fence: FenceCounter
    ) -> None:
        """Split the shards moving out with keys held or queued here; hand over the others to
        the split's node (else the target)."""
        moving = {s: dest for dest, shards in decision.moving_out.items() for s in shards}
        if not moving:
            return
        held = self.host.holders_in(sorted(moving))
        shard_map = view.shard_map
        done = handover_due(moving.keys(), held)
        to_split = {s: shard_map[s].split_to(moving[s]) for s in held if not shard_map[s].split}
        if to_split:
            # The fence first: the split's node raises its counter above it before granting.
            fence.publish()
            self._write_assignments(view, member, to_split)
        if not done:
            return
        fence.publish()  # before the next owner can read it
        written, _ = self._write_assignments(
            view, member, {s: shard_map[s].served_by(moving[s]) for s in done}
        )
        self.handovers += len(written)

    def unsplit(
        self, view: ClusterView, member: Member, now: float, gone_at: Mapping[str, int]
    ) -> None:
        """Drop a split towards a gone node (its free keys are unavailable here meanwhile) once
        every lease that node may have granted has ended: the wait of a failover, from when
        this member first saw it gone. The longest lease is read when the node is seen gone and
        again just before the drop, not at each step (a moving shard steps every tick)."""
        live = view.members
        gone = {
            s: a.split
            for s, a in view.shard_map.items()
            if a.current == self.advertise and a.split and a.split not in live
        }
        self._split_gone_since = {s: self._split_gone_since.get(s, now) for s in gone}
        nodes = set(gone.values())
        waits = {n: w for n, w in self._split_waits.items() if n in nodes}
        if not nodes <= waits.keys():
            waits = self._split_waits_of(nodes)
        self._split_waits = waits
        if not self._due_splits(gone, now):
            return
        self._split_waits = self._split_waits_of(nodes)  # read again before it is dropped
        due = self._due_splits(gone, now)
        if due:
            shard_map = view.shard_map
            by_gone: dict[str, dict[int, ShardAssignment]] = {}
            for s in due:
                by_gone.setdefault(gone[s], {})[s] = shard_map[s].unsplit()
            for node, new in by_gone.items():
                _, failed = self._write_while_gone(view, member, node, gone_at.get(node, 0), new)
                if failed:
                    # Registered again (or this member's lease is gone): wait again.
                    for s in new:
                        self._split_gone_since.pop(s, None)

    def _split_waits_of(self, nodes: Collection[str]) -> dict[str, float]:
        """Per node: its published longest lease (else ``max_lease_ttl_s``) + the margin."""
        if not nodes:
            return {}
        published = published_longest(self.client, self.prefix)
        margin = self.failover_margin_s
        return {n: published.get(n, self.max_lease_ttl_s) + margin for n in nodes}

    def _due_splits(self, gone: Mapping[int, str], now: float) -> list[int]:
        """The shards of ``gone`` (shard -> split node) whose wait is over."""
        since, waits = self._split_gone_since, self._split_waits
        return [s for s, node in gone.items() if now - since[s] >= waits[node]]

    def _write_while_gone(
        self,
        view: ClusterView,
        member: Member,
        gone: str,
        seen_gone_at: int,
        new: dict[int, ShardAssignment],
    ) -> tuple[frozenset[int], bool]:
        """``_write_assignments``, on condition too that ``gone`` (seen gone at revision
        ``seen_gone_at``; "" for none) has no member key and registered last at or before then.

        Absent: a member registering again as its shards are taken (or its split dropped) reads
        the map after registering, so it sees this write or makes it fail; it never serves,
        from a map read too early, a grant still in its table (kept by leases, or detached by
        a closing connection) while this member grants the key.

        Not registered since: a member that came back and died again unseen (a silent watch, a
        thread held up) granted leases the wait, counted from before, does not cover. Its
        registration key (``ClusterKeys.registered``, no lease) is newer: the write fails and
        the wait starts again. (A version writing no such key compares as never registered.)"""
        if not gone:
            return self._write_assignments(view, member, new)
        keys = member.keys
        absent = Compare(keys.member(gone), "CREATE", "EQUAL", 0)
        not_since = Compare(keys.registered(gone), "MOD", "LESS", seen_gone_at + 1)
        return self._write_assignments(view, member, new, also=(absent, not_since))

    def release(
        self, member: Member, keep: frozenset[int], fence: FenceCounter, now: float
    ) -> None:
        """Mark released the shards this member serves that nobody holds (a graceful leave)."""
        if member.lost is not None or now >= member.lease_valid_until:
            return  # lease not shown alive: the others may count a failover already
        alive = Compare(member.keys.member(self.advertise), "LEASE", "EQUAL", member.lease_id)
        published = False
        held: set[int] = set()
        released: set[int] = set()
        for _ in range(RELEASE_ATTEMPTS):
            view = read_view(self.client, self.prefix)
            mine = [s for s, a in view.shard_map.items() if a.current == self.advertise]
            # The snapshot is fenced: nothing can be granted after this answer.
            held = self.host.holders_in(mine) if mine else set()
            free = [s for s in mine if s not in held and s not in keep]
            if not free:
                break
            if not published:
                fence.publish()  # before any heir can see a shard released
                published = True
            writes = {
                s: ShardWrite(view.revisions.get(s, 0), view.shard_map[s].release()) for s in free
            }
            result = write_shards(self.client, member.keys.shards, writes, condition=alive)
            released.update(result.written)
            self.handovers += len(result.written)
            if result.condition_failed or not result.conflicted:
                break
        kept = len(held | keep)
        log.info(
            "cluster member %s: leaving; released %d shard(s) to their heirs at once "
            "(%d held or cut off: they wait for the failover)",
            self.advertise,
            len(released),
            kept,
        )

    def _write_assignments(
        self,
        view: ClusterView,
        member: Member,
        new: dict[int, ShardAssignment],
        *,
        also: Sequence[Compare] = (),
    ) -> tuple[frozenset[int], bool]:
        """Write, each on condition that the shard is as seen, this member alive and ``also``:
        the shards written, and whether a condition refused one (the rest were not written)."""
        # A write this view does not show yet is not repeated (it would only conflict).
        writes = {
            s: ShardWrite(view.revisions.get(s, 0), a)
            for s, a in new.items()
            if self._written_from.get(s) != view.revisions.get(s, 0)
        }
        self._written_from = {
            s: r for s, r in self._written_from.items() if view.revisions.get(s, 0) == r
        }
        if not writes:
            return frozenset(), False
        alive = Compare(member.keys.member(self.advertise), "LEASE", "EQUAL", member.lease_id)
        result = write_shards(self.client, member.keys.shards, writes, condition=[alive, *also])
        for s in result.written:
            self._written_from[s] = writes[s].revision
        if result.written:
            log.info(
                "cluster member %s: set the current node of %d shard(s)",
                self.advertise,
                len(result.written),
            )
        return frozenset(result.written), result.condition_failed
