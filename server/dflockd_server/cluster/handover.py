"""How a cluster member moves shards (``Handover``) when ``ClusterNode`` says: hands them over
(key by key: ``decide``), takes them after a failover, releases them when it leaves. Every
write is conditioned on the shard's revision and on this member's lease (``mapwrite``); the
fence ceiling is published before writing ``split=<target>`` and again before setting current
to the split's node.

The failover bound. A member that dies or loses etcd grants and renews nothing after its last
successful keep-alive's sending time + its lease TTL, no later than etcd expires its lease,
when the others see it gone. Its holders' leases end within the longest lease it granted or
renewed, which it publishes before granting a longer one (``<prefix>/longest/<member>``, no
lease; a failed write refuses the grant). The new owner waits that bound (``max_lease_ttl_s``
if none) + ``failover_margin_s`` from when it first saw the member gone: safe as long as
clock rates differ by less than the margin over that time.

A graceful leave (``ClusterNode.stop(leave=True)``, after the drain): the node refuses every
acquire, asks ``holders_in`` (on the loop: no grant can follow), publishes its fence ceiling,
writes the shards nobody holds released, and only then revokes its
lease; each heir takes them at once. The rest wait for the failover: among them the shards of
holders the shutdown timeout cut off, whose grants the table keeps till their leases end (a
close by the server frees nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence

from dflockd_server.cluster.decide import Decision
from dflockd_server.cluster.etcd import Compare, EtcdClient
from dflockd_server.cluster.fencestore import published_longest
from dflockd_server.cluster.host import NodeHost
from dflockd_server.cluster.mapwrite import ShardWrite, write_shards
from dflockd_server.cluster.membership import ClusterView, Member, read_view
from dflockd_server.cluster.shardmap import ShardAssignment
from dflockd_server.tokens import FenceCounter

log = logging.getLogger("dflockd_server")

__all__ = ["RELEASE_ATTEMPTS", "Handover"]

RELEASE_ATTEMPTS = 3  # a graceful leave's release attempts (a write may conflict with the leader's)


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
        self.forget()
        self.handovers = 0
        self.failovers = 0
        self.released_takeovers = 0

    def forget(self) -> None:
        self._written_from: dict[int, int] = {}
        self._split_gone_since: dict[int, float] = {}  # split towards a node not live: since when
        self._split_waits: dict[str, float] = {}  # each such node -> the wait for it
        self._waits: dict[str, float] = {}  # gone members whose shards it waits to take -> the wait

    def failover_waits(self, view: ClusterView, *, fresh: bool = False) -> dict[str, float]:
        """Per gone member whose shards this one waits to take: its published longest lease
        plus the margin, read when a member joins the waits and when ``fresh`` (before a
        failover), not at each decision."""
        me, live = self.advertise, view.members
        gone = {
            a.current
            for _, a in view.shard_map.items()
            if a.target == me and a.current and a.current not in live and not a.released
        }
        self._waits = self._waits_for(self._waits, gone, fresh=fresh)
        return self._waits

    def take_over(
        self, view: ClusterView, member: Member, shards: Collection[int], gone_at: Mapping[str, int]
    ) -> set[str]:
        """Set current = this member for shards whose failover is due; returns the gone
        members that registered since ``gone_at`` (``_write_while_gone``): their waits restart."""
        shard_map = view.shard_map
        new = {s: (shard_map[s].current, shard_map[s].served_by(self.advertise)) for s in shards}
        written, refused = self._write_while_gone(view, member, new, gone_at)
        released = sum(shard_map[s].released for s in written)
        self.released_takeovers += released
        self.failovers += len(written) - released
        return refused

    def move_out(
        self, view: ClusterView, member: Member, decision: Decision, fence: FenceCounter
    ) -> None:
        """Split the shards moving out with keys held or queued here; hand over the others."""
        moving = {s: dest for dest, shards in decision.moving_out.items() for s in shards}
        if not moving:
            return
        held = self.host.holders_in(sorted(moving))
        shard_map = view.shard_map
        done = moving.keys() - held
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
        """Drop a split towards a gone node once every lease it may have granted has ended
        (a failover's wait, from when first seen gone; the longest lease read then and again
        just before the drop)."""
        gone = {
            s: a.split
            for s, a in view.shard_map.items()
            if a.current == self.advertise and a.split and a.split not in view.members
        }
        self._split_gone_since = {s: self._split_gone_since.get(s, now) for s in gone}
        nodes = set(gone.values())
        self._split_waits = self._waits_for(self._split_waits, nodes)
        if not self._due_splits(gone, now):
            return
        self._split_waits = self._waits_for({}, nodes, fresh=True)  # read again before the drop
        if due := self._due_splits(gone, now):
            new = {s: (gone[s], view.shard_map[s].unsplit()) for s in due}
            _, refused = self._write_while_gone(view, member, new, gone_at)
            for s in due:
                if gone[s] in refused:
                    self._split_gone_since.pop(s, None)

    def _waits_for(
        self, known: Mapping[str, float], nodes: set[str], *, fresh: bool = False
    ) -> dict[str, float]:
        """Each node's wait: its published longest lease (``max_lease_ttl_s`` if none) plus the
        margin, read again for every node unless ``known`` has each (and not ``fresh``)."""
        if not nodes or (not fresh and nodes <= known.keys()):
            return {n: known[n] for n in nodes}
        published = published_longest(self.client, self.prefix)
        return {n: published.get(n, self.max_lease_ttl_s) + self.failover_margin_s for n in nodes}

    def _due_splits(self, gone: Mapping[int, str], now: float) -> list[int]:
        since, waits = self._split_gone_since, self._split_waits
        return [s for s, node in gone.items() if now - since[s] >= waits[node]]

    def _write_while_gone(
        self,
        view: ClusterView,
        member: Member,
        new: Mapping[int, tuple[str, ShardAssignment]],
        gone_at: Mapping[str, int],
    ) -> tuple[frozenset[int], set[str]]:
        """Write each shard's assignment (``_write_assignments``), grouped by the gone node it
        names (``""``: none), on condition too that the node has no member key (a member
        registering again reads the map after, so it sees this write or fails it) and has not
        registered since ``gone_at`` (a life unseen in between granted leases the wait does not
        cover): the shards written, and the gone nodes whose condition refused a write."""
        by_gone: dict[str, dict[int, ShardAssignment]] = {}
        for s, (gone, assignment) in new.items():
            by_gone.setdefault(gone, {})[s] = assignment
        written: frozenset[int] = frozenset()
        refused: set[str] = set()
        for gone, assignments in by_gone.items():
            also: tuple[Compare, ...] = ()
            if gone:
                also = (
                    Compare(member.keys.member(gone), "CREATE", "EQUAL", 0),
                    Compare(member.keys.registered(gone), "MOD", "LESS", gone_at.get(gone, 0) + 1),
                )
            done, failed = self._write_assignments(view, member, assignments, also=also)
            written |= done
            if failed and gone:
                refused.add(gone)
        return written, refused

    def release(self, member: Member, fence: FenceCounter, now: float) -> None:
        """Mark released the shards this member serves that nobody holds (a graceful leave)."""
        if member.lost is not None or now >= member.lease_valid_until:
            return  # the others may count a failover already
        alive = Compare(member.keys.member(self.advertise), "LEASE", "EQUAL", member.lease_id)
        published = False
        held: set[int] = set()
        released: set[int] = set()
        for _ in range(RELEASE_ATTEMPTS):
            view = read_view(self.client, self.prefix)
            mine = [s for s, a in view.shard_map.items() if a.current == self.advertise]
            held = self.host.holders_in(mine) if mine else set()
            free = [s for s in mine if s not in held]
            if not free:
                break
            if not published:
                fence.publish()  # before any heir can see a shard released
                published = True
            writes = {
                s: ShardWrite(view.revisions.get(s, 0), view.shard_map[s].release()) for s in free
            }
            result = write_shards(self.client, member.keys.shards, writes, condition=[alive])
            released.update(result.written)
            self.handovers += len(result.written)
            if result.condition_failed or not result.conflicted:
                break
        log.info(
            "cluster member %s: leaving; released %d shard(s) to their heirs at once "
            "(%d held, cut-off holders included: they wait for the failover)",
            self.advertise,
            len(released),
            len(held),
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
        the shards written, and whether a condition refused one. A write this view does not
        show yet is not repeated (it would only conflict)."""
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
