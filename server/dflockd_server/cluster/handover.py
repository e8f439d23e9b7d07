"""How a cluster member moves shards (``Handover``): hands them over, takes them after a
failover, releases them when it leaves. ``ClusterNode`` (``node``) decides when; every write
here is conditioned on the shard's revision and on this member's lease (``mapwrite``).

Handover, key by key (``decide``'s docstring, docs/protocol.md *Key-level moves*): for shards
moving out, while a key is held or queued here, the member writes the flag ``split=<target>``
(after publishing its fence ceiling), so that the other keys are asked for at the target; once
``NodeHost.holders_in`` shows nothing held or queued, it publishes its fence ceiling and sets
the shard's current node to the split's node, dropping the flag. A split towards a member that
is gone is dropped after that member's longest lease (``unsplit``).

Failover: for shards whose current member is gone, the member waits
``max_lease_ttl_s + failover_margin_s`` from when it first saw that, then sets current = itself
(same conditions); a shard *released* by a member that left gracefully (see below) it takes at
once.

The failover bound. A member that dies, or loses etcd, grants and renews nothing after its
last successful keep-alive's sending time + ``lease_ttl_s``, which is no later than etcd
expires its lease (etcd counts from receipt, and may raise a short TTL to its minimum, about
2 s with default timings: that only delays the expiry). The others see it gone when etcd
expires the lease: detection takes at most the lease's TTL after its last keep-alive. Its
holders' leases end within the longest lease it granted or renewed of its last grant or
renewal; before granting or renewing a longer lease than ever before, a member publishes the new
bound in etcd (``<prefix>/longest/<member>``, no lease: it outlives the member; a failed write
refuses the grant). The new owner waits that published bound + ``failover_margin_s`` from when
it first saw the shard's current member gone (``max_lease_ttl_s`` + the margin for a member that
published none), so it grants only after every lease the dead member granted has ended (given
clocks whose rates differ by less than the margin over that time). A dead member's keys are
therefore unavailable for at most: etcd lease TTL (detection, plus an election and a map update
by the leader, a few etcd round trips) + the longest lease its clients used +
``failover_margin_s`` + a tick (``NODE_TICK_S``): about one real lease, not the longest any
member could grant.

A graceful leave (``ClusterNode.stop(leave=True)``, after the server's drain) hands its shards
over instead of making the others wait. The node stops deciding and refuses every acquire;
then, for each shard whose current node it is, it asks ``NodeHost.holders_in`` (on the loop: no
grant can follow) and leaves out the shards the server names in ``keep`` (those whose holders
the shutdown timeout cut off: they may still believe they hold, so they get the failover wait).
It publishes its fence ceiling, then writes the others' current node empty with the flag
``released`` (``ShardAssignment.release``; each on condition of the shard's revision and of its
own lease), and only then revokes its lease. The leader gives the shards new targets, and each
heir, seeing a released shard, sets current = itself at once and raises its fence above every
published ceiling before granting: the keys are unavailable for about the time of a few etcd
round trips, not for the longest lease. Shards still held, kept, or whose write conflicted,
and every shard when the member cannot show its lease alive, are left to the failover wait.
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
"""A graceful leave reads the map again and retries the shards whose write conflicted (the
leader may be writing the same shards) this many times in all."""


class Handover:
    """The shard moves of one cluster member (see the module's docstring), called from its
    node's thread (``release``: once that thread stopped)."""

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
        """Nodes not live that this member's shards are split towards: the wait read for each
        (the longest lease it published, ``max_lease_ttl_s`` if none, plus the margin)."""
        self._waits: dict[str, float | None] = {}
        """Gone members whose shards this one waits to take: the wait read for each (None:
        it published no longest lease)."""
        # Counters (the node's thread adds; a scrape reads).
        self.handovers = 0
        self.failovers = 0
        self.released_takeovers = 0

    def forget(self) -> None:
        """Forget what was seen and written (the member fenced itself: a rejoin starts
        afresh)."""
        self._split_gone_since = {}
        self._split_waits = {}
        self._written_from = {}
        self._waits = {}

    def failover_waits(self, view: ClusterView, *, fresh: bool = False) -> dict[str, float] | None:
        """For each gone member whose shards this one waits to take: the longest lease it
        published, plus the margin. Read from etcd once the member is seen gone (a gone member
        grants nothing more, so it publishes no longer lease that counts), when another member
        joins the waits, and when ``fresh`` (before a failover is carried out); not at every
        decision while the wait runs, which news from etcd (the leader's new targets, in
        batches, and the others' failovers) brings many times."""
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
        """Set current = this member for shards whose failover wait is over (or that their
        member released), each on condition that their gone member has not registered again
        since this member saw it gone (``_write_while_gone``; ``gone_at``: the revision of the
        view that first showed each gone member so). The gone members whose writes that
        condition refused: their waits start again."""
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
        """Key by key: a shard moving out with keys held or queued here is split first
        (``split=<target>``, then its other keys are asked for there); a shard with nothing
        held or queued here any more is handed over to its split's node (its target when it
        never split)."""
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
        """A shard split towards a node that is gone: its free keys are unavailable here
        meanwhile. Once every lease that node may have granted has surely ended (the longest
        it published, ``max_lease_ttl_s`` if none, plus the margin, counted from when this
        member first saw it gone, as a failover), the split is dropped and the shard moves on
        as any other. That longest lease is read from etcd when the node is seen gone and
        again just before a split is dropped, not at each step (a shard moving out makes the
        node's thread step every tick)."""
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
                    # Registered again since it was seen gone (or this member's lease is
                    # gone): the wait starts again.
                    for s in new:
                        self._split_gone_since.pop(s, None)

    def _split_waits_of(self, nodes: Collection[str]) -> dict[str, float]:
        """For each node: the longest lease it published (``max_lease_ttl_s`` if none), plus
        the margin (one read from etcd; none for no nodes)."""
        if not nodes:
            return {}
        published = published_longest(self.client, self.prefix)
        margin = self.failover_margin_s
        return {n: published.get(n, self.max_lease_ttl_s) + margin for n in nodes}

    def _due_splits(self, gone: Mapping[int, str], now: float) -> list[int]:
        """The shards of ``gone`` (shard -> the node not live it is split towards) whose wait
        is over."""
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
        """``_write_assignments``, on condition too that ``gone`` (a member this one saw gone
        in the view of revision ``seen_gone_at``; "" for none) has no member key in etcd, and
        registered last at or before that revision.

        Absent: a member that registers again just as its shards are taken (a failover) or its
        split dropped (an unsplit) reads the map after its registration, so it either sees
        this write or makes it fail; it never serves, from a map read a moment too early, a
        grant it still has in its table (one its leases kept, or one a closing connection
        detached) while this member grants the key.

        Not registered since: a member that came back and died again while this one's view
        missed it (a silent watch, a thread held up for seconds) granted or renewed leases in
        that life, which the wait, counted from before it, does not cover. Its registration
        key (``ClusterKeys.registered``, no lease) was put after the revision: the write fails
        and the wait starts again. (A member of a version that writes no such key compares as
        never registered: the condition is as before.)"""
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
            return  # it cannot show its lease alive: the others may count a failover already
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
        """Write, each on condition that the shard is as seen and this member still alive
        (and ``also``): the shards written, and whether one of those other conditions refused
        a write (the shards after it were not written)."""
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
