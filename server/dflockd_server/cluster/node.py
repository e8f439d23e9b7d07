"""The cluster member inside a lock server: decides, safely, which keys this server serves.

A ``ClusterNode`` runs a ``membership.Member`` (registration under an etcd lease, election,
the leader's map upkeep) and one thread of its own that, on every change of the view, of the
lease, and every ``NODE_TICK_S``:

1. asks ``decide.decide`` (pure) what each shard is: serve, moving out, taking over, failover,
   other; publishes the verdicts as an immutable ``snapshot.ClusterOwnership``, swapped whole;
2. before serving a shard it did not serve a moment ago, raises its fencing counter above the
   highest ceiling any member published (``<prefix>/fence/<member>``, kept outside the members'
   leases so a dead member's survives): every token it grants is then above every token any
   previous owner granted, after a handover as after a failover. Until that succeeded the
   shard answers ``error_unavailable``;
3. for shards moving out, key by key (``decide``'s docstring, docs/protocol.md *Key-level
   moves*): while a key is held or queued here, writes the flag ``split=<target>`` (after
   publishing its fence ceiling), so that the other keys are asked for at the target; once
   ``NodeHost.holders_in`` shows nothing held or queued, publishes its fence ceiling and sets
   the shard's current node to the split's node, dropping the flag (a write conditioned on
   the shard's revision and on this member's lease). A split towards a member that is gone
   is dropped after that member's longest lease (``_unsplit``);
4. for shards whose current member is gone: waits ``max_lease_ttl_s + failover_margin_s`` from
   when it first saw that, then sets current = itself (same conditions); a shard *released*
   by a member that left gracefully (see below) it takes at once.

Self-fencing. The member's etcd lease surely lives until the last *successful* keep-alive's
*sending* time plus its TTL (``Member.lease_valid_until``). From then on (or once the lease is
lost) the node answers every acquire ``error_unavailable`` and calls
``NodeHost.renewals_allowed(False)``, so its holders' renewals fail; the snapshot itself
compares the clock with that time, so even a paused process grants nothing late. When etcd
answers again the node joins with a new lease and resumes from a fresh read of the map.

A member whose own key vanishes from its view (its lease revoked, or expired before its
keep-alive noticed) fences at once too, and joins again.

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

A graceful leave (``stop(leave=True)``, after the server's drain) hands its shards over instead
of making the others wait. The node stops deciding and refuses every acquire; then, for each
shard whose current node it is, it asks ``NodeHost.holders_in`` (on the loop: no grant can
follow) and leaves out the shards the server names in ``keep`` (those whose holders the
shutdown timeout cut off: they may still believe they hold, so they get the failover wait). It
publishes its fence ceiling, then writes the others' current node empty with the flag
``released`` (``ShardAssignment.release``; each on condition of the shard's revision and of its
own lease), and only then revokes its lease. The leader gives the shards new targets, and each
heir, seeing a released shard, sets current = itself at once and raises its fence above every
published ceiling before granting: the keys are unavailable for about the time of a few etcd
round trips, not for the longest lease. Shards still held, kept, or whose write conflicted,
and every shard when the member cannot show its lease alive, are left to the failover wait.

Metrics (``stats``): the shards per state of the current decision (counted in the decision's
one pass over the map), whether the member is fenced or the leader, and counters of the shards
it handed over, took over after a failover, and took at once after a release.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

from dflockd_server.cluster.decide import (
    ERROR_UNAVAILABLE,
    FENCED,
    Decision,
    decide,
    handover_due,
)
from dflockd_server.cluster.etcd import Compare, EtcdClient, EtcdError
from dflockd_server.cluster.fencestore import (
    EtcdCeilingStore,
    EtcdLongestStore,
    highest_ceiling,
    published_longest,
)
from dflockd_server.cluster.host import NodeHost
from dflockd_server.cluster.mapwrite import ShardWrite, write_shards
from dflockd_server.cluster.membership import ClusterView, Member
from dflockd_server.cluster.ops import read_view
from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardAssignment, ShardMap
from dflockd_server.cluster.snapshot import ClusterOwnership
from dflockd_server.fence import FenceCounter, FenceStateError

log = logging.getLogger("dflockd_server")

__all__ = ["ClusterNode", "ClusterStats", "NodeHost"]

NODE_TICK_S = 0.1
"""How often the node looks again without news (handovers wait for holders, failovers for
time)."""

FAILOVER_MARGIN_S = 1.0
"""Added to the longest lock lease before a failover: clock rates, a tick, etcd's delays."""

NODE_QUIET_S = 0.02
"""News is decided once it has been quiet this long (a map being written is a burst of news)..."""

NODE_MAX_DEFER_S = 0.25
"""...or once it has been deferred this long."""


def boottime() -> float:
    """Seconds on a clock that also counts the time the machine was suspended
    (``CLOCK_BOOTTIME`` where there is one, else the monotonic clock): a member whose machine
    slept past its etcd lease must see that lease as over when it wakes."""
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return time.monotonic()
    return time.clock_gettime(clock_id)


REJOIN_RETRY_S = 0.5
"""Between attempts to join again after this member lost its etcd lease."""

RELEASE_ATTEMPTS = 3
"""A graceful leave reads the map again and retries the shards whose write conflicted (the
leader may be writing the same shards) this many times in all."""


@dataclass(frozen=True, slots=True)
class ClusterStats:
    """What the metrics report about a cluster member (``ClusterNode.stats``)."""

    shards: Mapping[str, int]
    """Shards per state (``decide.SHARD_STATES``), adding up to ``SHARD_COUNT``."""
    fenced: bool
    leader: bool
    handovers: int
    """Shards this member handed over (to their target, or released on a graceful leave)."""
    failovers: int
    """Shards this member took over after waiting out a gone member's longest lease."""
    released_takeovers: int
    """Shards this member took at once because their member had released them."""
    etcd_switches: int = 0
    """Times this member's etcd client moved to another etcd endpoint (one failed or was slow)."""


class ClusterNode:
    """One lock server's cluster member (see the module's docstring); ``start`` then ``stop``.

    The node is itself the server's ``Ownership`` (``check``, ``may_hold``, ``describe``
    delegate to the current snapshot) and owns the server's ``fence`` counter.
    """

    def __init__(
        self,
        etcd_client: EtcdClient,
        prefix: str,
        advertise: str,
        host: NodeHost,
        *,
        max_lease_ttl_s: float,
        lease_ttl_s: int = 5,
        settle_s: float = 2.0,
        failover_margin_s: float = FAILOVER_MARGIN_S,
        clock: Callable[[], float] = boottime,
        fence: FenceCounter | None = None,
    ) -> None:
        if max_lease_ttl_s <= 0:
            raise ValueError("the longest lock lease (--max-lease-ttl) must be positive")
        if lease_ttl_s < 1:
            raise ValueError("the cluster member's etcd lease TTL must be at least 1 s")
        self.client = etcd_client
        self.prefix = prefix
        self.advertise = advertise
        self.host = host
        self.max_lease_ttl_s = max_lease_ttl_s
        self.lease_ttl_s = lease_ttl_s
        self.settle_s = settle_s
        self.failover_margin_s = failover_margin_s
        self.failover_wait_s = max_lease_ttl_s + failover_margin_s
        """The wait for a gone member that published no longest lease."""
        self._clock = clock
        self._fence = fence
        self._member: Member | None = None
        self._ownership = self._fenced_snapshot(ClusterView(frozenset(), None, ShardMap()))
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Owned by the node's thread:
        self._failover_since: dict[int, float] = {}
        self._raised: frozenset[int] = frozenset()
        self._current: frozenset[int] = frozenset()
        """The shards this member was current member of at the last decision."""
        self._written_from: dict[int, int] = {}
        self._split_gone_since: dict[int, float] = {}
        """Shards this member splits towards a node that is not live: since when (seen)."""
        self._renewals: bool | None = None
        self._next_join = 0.0
        self._updates = 0  # views the member reported (its watch's thread adds)
        self._seen_updates = -1
        self._quiet = False  # nothing waits on time or on holders: decide only on news
        self.fenced_reason: str | None = "not started"
        # Counters (the node's thread adds; a scrape reads).
        self.handovers = 0
        self.failovers = 0
        self.released_takeovers = 0

    # -- the Ownership protocol ------------------------------------------------------------------

    @property
    def ownership(self) -> ClusterOwnership:
        """The current snapshot (immutable; replaced whole)."""
        return self._ownership

    def check(self, key: str) -> bytes | None:
        return self._ownership.check(key)

    def check_asked(self, key: str) -> bytes | None:
        return self._ownership.check_asked(key)

    def may_hold(self, key: str) -> bool:
        return self._ownership.may_hold(key)

    def describe(self) -> dict[str, object]:
        return self._ownership.describe()

    @property
    def fence(self) -> FenceCounter:
        """The fencing counter the server must use (its ceiling is stored in etcd)."""
        if self._fence is None:
            raise RuntimeError("the cluster node has no fence counter before start()")
        return self._fence

    def publish_longest(self, longest: int) -> None:
        """Store in etcd the longest lease this member may have granted (before it grants a
        longer one; raises ``FenceStateError`` when it cannot: the lease is then refused)."""
        EtcdLongestStore(self.client, self.prefix, self.advertise).write(longest)

    @property
    def member(self) -> Member | None:
        return self._member

    def stats(self) -> ClusterStats:
        """The metrics' view of this member: cheap (counts kept from the last decision)."""
        own = self._ownership
        fenced = not own.alive()
        member = self._member
        return ClusterStats(
            shards=FENCED.states if fenced else own.states,
            fenced=fenced,
            leader=not fenced and member is not None and member.is_leader,
            handovers=self.handovers,
            failovers=self.failovers,
            released_takeovers=self.released_takeovers,
            etcd_switches=self.client.switches,
        )

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> ClusterNode:
        """Join (raises ``EtcdError`` when etcd cannot be reached) and start deciding."""
        if self._fence is None:
            store = EtcdCeilingStore(self.client, self.prefix, self.advertise)
            self._fence = FenceCounter(store=store)
        self._member = self._new_member().start()
        self._thread = threading.Thread(
            target=self._run, name=f"dflockd-node {self.advertise}", daemon=True
        )
        self._thread.start()
        self._wake.set()
        return self

    def stop(
        self, *, leave: bool = True, timeout: float = 10.0, keep: Collection[int] = ()
    ) -> None:
        """Stop deciding (every acquire refused from now on), then leave (``leave``: release
        the shards nobody holds, except those in ``keep``, then revoke the lease; see the
        module's docstring) or let the lease run out (a crash).

        ``keep``: shards whose holders were cut off (the server's shutdown timeout ran out):
        they may still believe they hold, so those shards wait for the failover."""
        self.halt(timeout)
        member, self._member = self._member, None
        if member is None:
            return
        if leave:
            try:
                self._release(member, frozenset(keep))
            except (EtcdError, FenceStateError) as exc:
                log.warning(
                    "cluster member %s: cannot release its shards (%s): they wait for the failover",
                    self.advertise,
                    exc,
                )
        member.stop(leave=leave, timeout=timeout)

    def halt(self, timeout: float = 10.0) -> None:
        """Stop deciding: every acquire refused, no shard handed over or taken from now on;
        still a member (``stop`` then leaves). The server calls it before it closes the
        connections of holders its shutdown timeout cut off: their closes release nothing
        that may still be held (the next run restores their leases), so no handover may
        follow them."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._ownership = self._fenced_snapshot(self._ownership.view)

    def _release(self, member: Member, keep: frozenset[int]) -> None:
        """Mark released the shards this member serves that nobody holds (a graceful leave)."""
        if member.lost is not None or self._clock() >= member.lease_valid_until:
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
                self.fence.publish()  # before any heir can see a shard released
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

    def __enter__(self) -> ClusterNode:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wake(self) -> None:
        """Look again now (a test, or news from the server)."""
        self._wake.set()

    def _new_member(self) -> Member:
        return Member(
            self.client,
            self.prefix,
            self.advertise,
            lease_ttl=self.lease_ttl_s,
            settle_s=self.settle_s,
            on_lease=lambda _until: self._wake.set(),
            on_update=self._on_update,
            clock=self._clock,
        )

    def _on_update(self) -> None:
        self._updates += 1
        self._wake.set()

    # -- the node's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(NODE_TICK_S)
            self._wake.clear()
            if self._stopping.is_set():
                return
            self._let_news_settle()
            try:
                self._step()
            except (EtcdError, FenceStateError) as exc:
                log.warning("cluster member %s: %s (trying again)", self.advertise, exc)
            except Exception:
                log.exception("cluster member %s: unexpected error", self.advertise)

    def _let_news_settle(self) -> None:
        deadline = self._clock() + NODE_MAX_DEFER_S
        seen = self._updates
        while seen != self._seen_updates and self._clock() < deadline:
            if self._stopping.wait(NODE_QUIET_S):
                return
            if self._updates == seen:
                return
            seen = self._updates

    def _step(self) -> None:
        member = self._member
        now = self._clock()
        valid_until = 0.0 if member is None else member.lease_valid_until
        reason = self._why_not_a_member(member, now)
        if member is None or reason is not None:
            self._self_fence(reason or "not joined")
            if now >= self._next_join:
                self._next_join = now + REJOIN_RETRY_S
                self._rejoin(member)
            return
        updates = self._updates
        if updates == self._seen_updates and self._quiet:
            own = self._ownership
            if own.valid_until != valid_until:  # a keep-alive went through
                self._ownership = replace(own, valid_until=valid_until)
            return
        self._seen_updates = updates
        view = member.snapshot()
        if self.advertise not in view.members:
            # Its key is gone (its lease revoked, or expired unnoticed): the others may already
            # count the wait for a failover. Grant nothing from now on; join again.
            self._self_fence("this member's key vanished from etcd")
            self._next_join = now + REJOIN_RETRY_S
            self._rejoin(member)
            return
        decision = self._decide(view, now)
        self._publish(view, decision, valid_until)
        self._fail_waiters_of_lost_shards(decision)
        gained = decision.granting - self._raised
        if gained:
            # Above every ceiling another member published: above all tokens ever granted for
            # these shards (its own are below its counter). Until then they stay unavailable.
            self.fence.raise_to(highest_ceiling(self.client, self.prefix, self.advertise))
            self._raised = decision.granting
            decision = self._decide(view, now)
            self._publish(view, decision, valid_until)
        else:
            self._raised = self._raised & decision.granting
        self._allow_renewals(True)
        self._failover_since = dict(decision.failover_since)
        self._quiet = not decision.failover_since and not decision.moving_out
        self._move_out(view, member, decision)
        self._unsplit(view, member, now)
        if decision.failover_due:
            shard_map = view.shard_map
            written = self._write_assignments(
                view,
                member,
                {s: shard_map[s].served_by(self.advertise) for s in decision.failover_due},
            )
            released = sum(shard_map[s].released for s in written)
            self.released_takeovers += released
            self.failovers += len(written) - released

    def _fail_waiters_of_lost_shards(self, decision: Decision) -> None:
        """The shards that stopped being this member's (taken by another, or unassigned):
        their queued waiters are answered with the shard's verdict at once, never granted
        later (the table asks the ownership before each promotion, too)."""
        current = self._ownership.current
        lost = self._current - current
        self._current = current
        by_reply: dict[bytes, list[int]] = {}
        for shard in sorted(lost):
            reply = decision.verdicts[shard]
            if reply is not None:
                by_reply.setdefault(reply, []).append(shard)
        for reply, shards in by_reply.items():
            self.host.fail_waiters(shards, reply)

    def _why_not_a_member(self, member: Member | None, now: float) -> str | None:
        if member is None:
            return "not joined"
        if member.lost is not None:
            return member.lost
        if now >= member.lease_valid_until:
            return f"etcd lease not renewed for {self.lease_ttl_s} s"
        return None

    def _decide(self, view: ClusterView, now: float) -> Decision:
        """The decision, holding back the shards not yet covered by a raised fence."""
        return decide(
            view,
            self.advertise,
            now=now,
            failover_since=self._failover_since,
            failover_wait_s=self.failover_wait_s,
            cleared=self._raised,
            failover_waits=self._failover_waits(view),
        )

    def _failover_waits(self, view: ClusterView) -> dict[str, float] | None:
        """For each gone member whose shards this one waits to take: the longest lease it
        published, plus the margin (read from etcd only while such a wait runs)."""
        me, live = self.advertise, view.members
        gone = {
            a.current
            for _, a in view.shard_map.items()
            if a.target == me and a.current and a.current not in live and not a.released
        }
        if not gone:
            return None
        published = published_longest(self.client, self.prefix)
        return {m: published[m] + self.failover_margin_s for m in gone if m in published}

    def _move_out(self, view: ClusterView, member: Member, decision: Decision) -> None:
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
            self.fence.publish()
            self._write_assignments(view, member, to_split)
        if not done:
            return
        self.fence.publish()  # before the next owner can read it
        written = self._write_assignments(
            view, member, {s: shard_map[s].served_by(moving[s]) for s in done}
        )
        self.handovers += len(written)

    def _unsplit(self, view: ClusterView, member: Member, now: float) -> None:
        """A shard split towards a node that is gone: its free keys are unavailable here
        meanwhile. Once every lease that node may have granted has surely ended (the longest
        it published, ``max_lease_ttl_s`` if none, plus the margin, counted from when this
        member first saw it gone, as a failover), the split is dropped and the shard moves on
        as any other."""
        live = view.members
        gone = {
            s: a.split
            for s, a in view.shard_map.items()
            if a.current == self.advertise and a.split and a.split not in live
        }
        self._split_gone_since = {s: self._split_gone_since.get(s, now) for s in gone}
        if not gone:
            return
        published = published_longest(self.client, self.prefix)
        due = [
            s
            for s, node in gone.items()
            if now - self._split_gone_since[s]
            >= published.get(node, self.max_lease_ttl_s) + self.failover_margin_s
        ]
        if due:
            shard_map = view.shard_map
            self._write_assignments(view, member, {s: shard_map[s].unsplit() for s in due})

    def _write_assignments(
        self, view: ClusterView, member: Member, new: dict[int, ShardAssignment]
    ) -> frozenset[int]:
        """Write, each on condition that the shard is as seen and this member still alive;
        the shards written."""
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
            return frozenset()
        alive = Compare(member.keys.member(self.advertise), "LEASE", "EQUAL", member.lease_id)
        result = write_shards(self.client, member.keys.shards, writes, condition=alive)
        for s in result.written:
            self._written_from[s] = writes[s].revision
        if result.written:
            log.info(
                "cluster member %s: set the current node of %d shard(s)",
                self.advertise,
                len(result.written),
            )
        return frozenset(result.written)

    # -- publishing ------------------------------------------------------------------------------

    def _publish(self, view: ClusterView, decision: Decision, valid_until: float) -> None:
        current = decision.serving.union(*decision.moving_out.values())
        member = self._member
        self._ownership = ClusterOwnership(
            self.advertise,
            view,
            decision.verdicts,
            valid_until,
            self._clock,
            decision.states,
            current=current,
            holding=decision.holding,
            importing=decision.importing,
            present=self.host.key_present,
            lease_until=(lambda: member.lease_valid_until) if member is not None else None,
        )
        if self.fenced_reason is not None:
            log.info("cluster member %s: deciding (was: %s)", self.advertise, self.fenced_reason)
            self.fenced_reason = None

    def _fenced_snapshot(self, view: ClusterView) -> ClusterOwnership:
        return ClusterOwnership(
            self.advertise, view, FENCED.verdicts, 0.0, self._clock, FENCED.states, fenced=True
        )

    def _allow_renewals(self, allowed: bool) -> None:
        if self._renewals is not allowed:
            self.host.renewals_allowed(allowed)
            self._renewals = allowed

    def _self_fence(self, reason: str) -> None:
        """Grant nothing, renew nothing; answer every queued waiter ``error_unavailable`` at
        once; forget what was seen (a rejoin starts afresh)."""
        if not self._ownership.fenced:
            self._ownership = self._fenced_snapshot(self._ownership.view)
            self._current = frozenset()
            # On the loop, after the fenced snapshot is in place: no waiter is queued later.
            self.host.fail_waiters(range(SHARD_COUNT), ERROR_UNAVAILABLE)
        self._allow_renewals(False)
        if self.fenced_reason is None:
            log.warning("cluster member %s: fenced, granting nothing: %s", self.advertise, reason)
        self.fenced_reason = reason
        self._failover_since = {}
        self._raised = frozenset()
        self._split_gone_since = {}
        self._written_from = {}
        self._seen_updates = -1
        self._quiet = False

    def _rejoin(self, old: Member | None) -> None:
        """Join again under a new lease, from a fresh read of everything (``Member.start``)."""
        if old is not None:
            old.stop(leave=False)
            if old.lease_id:
                # Its keys go first (the member key is registered anew only where no lease
                # holds it), a leadership it held with them.
                with contextlib.suppress(EtcdError):
                    self.client.lease_revoke(old.lease_id)
        self._member = None
        try:
            member = self._new_member().start()
        except EtcdError as exc:
            log.debug("cluster member %s: cannot join again yet: %s", self.advertise, exc)
            return
        self._member = member
        log.warning("cluster member %s: joined again (lease %x)", self.advertise, member.lease_id)
        self._wake.set()
