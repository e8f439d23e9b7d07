"""The cluster member inside a lock server: decides, safely, which keys this server serves.

A ``ClusterNode`` runs a ``membership.Member`` (registration under an etcd lease, election,
the leader's map upkeep) and one thread of its own that, on every change of the view, of the
lease, and every ``NODE_TICK_S``:

1. asks ``decide.decide`` (pure) what each shard is: serve, moving out, taking over, failover,
   other; hands the verdicts to its server as an immutable ``snapshot.ClusterOwnership``
   (``NodeHost.set_ownership``), swapped whole, before it acts on them;
2. before granting on a shard under an assignment (its current member and split) it did not
   grant under a moment ago, raises its fencing counter above the highest ceiling any member
   published (``<prefix>/fence/<member>``, kept outside the members' leases so a dead member's
   survives): every token it grants is then above every token any previous owner granted,
   after a handover, a failover, a split, an unsplit, a restart in place. Until that succeeded
   the shard answers ``error_unavailable``. A key asked for during a split is granted only
   above the counter the exporting member signed into the ask ticket (``asktickets``);
3. for shards moving out, key by key, splits them while keys are held or queued here and
   hands them over once none is (``handover``);
4. for shards whose current member is gone, takes them after the failover wait (at once when
   their member released them on a graceful leave); ``handover`` tells how long that wait is
   and why it suffices.

Self-fencing. The member's etcd lease surely lives until the last *successful* keep-alive's
*sending* time plus its TTL (``Member.lease_valid_until``). From then on (or once the lease is
lost) the node answers every acquire ``error_unavailable`` and calls
``NodeHost.renewals_allowed(False)``, so its holders' renewals fail; the snapshot itself
compares the clock with that time, read live (a keep-alive needs no new snapshot), so even a
paused process grants nothing late. When etcd answers again the node joins with a new lease
and resumes from a fresh read of the map.

A member whose own key vanishes from its view (its lease revoked, or expired before its
keep-alive noticed) fences at once too, and joins again.

A graceful leave (``stop(leave=True)``, after the server's drain) releases the shards nobody
holds to their heirs at once instead of making them wait (``handover``).

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
from dataclasses import dataclass

from dflockd_server.cluster.asktickets import AskTickets, new_secret
from dflockd_server.cluster.clockskew import ClockSkew
from dflockd_server.cluster.decide import ERROR_UNAVAILABLE, FENCED, Decision, decide
from dflockd_server.cluster.etcd import EtcdClient, EtcdError
from dflockd_server.cluster.fencestore import EtcdCeilingStore, EtcdLongestStore, highest_ceiling
from dflockd_server.cluster.handover import Handover
from dflockd_server.cluster.host import NodeHost
from dflockd_server.cluster.membership import ClusterView, Member
from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardMap
from dflockd_server.cluster.snapshot import ClusterOwnership
from dflockd_server.fence import FenceStateError
from dflockd_server.tokens import FenceCounter

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


def ask_secret_key(prefix: str) -> str:
    """Where the cluster's ask secret lives (``<prefix>/asksecret``, no lease)."""
    return prefix + "/asksecret"


def load_ask_tickets(client: EtcdClient, prefix: str) -> AskTickets:
    """The cluster's ask tickets: its secret read from etcd, created there first (by a
    conditional put: every member reads the one that won) when none is."""
    key = ask_secret_key(prefix)
    kv = client.get(key)
    if kv is None:
        client.create_if_absent(key, new_secret())
        kv = client.get(key)
        if kv is None:
            raise EtcdError(f"the cluster's ask secret {key!r} vanished while being created")
    return AskTickets(kv.value.strip())


AUTO_REBALANCE_S = 10.0
"""How long membership must be still before the leader evens the members out by itself (a
member restarted in place, or a new one, gets its share back about this long after it joined,
plus its handovers)."""

REJOIN_RETRY_S = 0.5
"""Between attempts to join again after this member lost its etcd lease."""


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
    fenced_reason: str | None = None
    """Why it is fenced (None: it is not, or it did not say)."""
    clock_offset_s: float = 0.0
    """How far its wall clock was from a ticket issuer's at the last ticket (``ClockSkew``)."""
    clock_off: bool = False
    """That offset was more than an ask ticket lives."""
    clock_peer: str = ""
    """The member whose ticket showed it."""
    stale_tickets: int = 0
    """Genuine ask tickets refused because they arrived expired by this member's clock."""


class ClusterNode:
    """One lock server's cluster member (see the module's docstring); ``start`` then ``stop``.

    It hands its host each snapshot (the server's ``Ownership``) and owns the server's
    ``fence`` counter.
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
        auto_rebalance_s: float | None = AUTO_REBALANCE_S,
        failover_margin_s: float = FAILOVER_MARGIN_S,
        clock: Callable[[], float] = boottime,
        fence: FenceCounter | None = None,
        wall: Callable[[], float] = time.time,
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
        self.auto_rebalance_s = auto_rebalance_s
        self.failover_margin_s = failover_margin_s
        self.failover_wait_s = max_lease_ttl_s + failover_margin_s
        """The wait for a gone member that published no longest lease."""
        self._clock = clock
        self._wall = wall
        """The wall clock its ask tickets' expiry is counted on (``ClusterOwnership.wall``)."""
        self._fence = fence
        self._member: Member | None = None
        self._ownership = self._fenced_snapshot(ClusterView(frozenset(), None, ShardMap()))
        host.set_ownership(self._ownership)  # grant nothing until the first decision
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Owned by the node's thread:
        self._failover_since: dict[int, float] = {}
        self._gone_at: dict[str, int] = {}
        """Each member the map names (current or split) that is not live -> the revision of
        the first view that showed it so (its waits count from then; ``Handover.take_over``)."""
        self._raised: dict[int, tuple[str, str]] = {}
        """Shard -> the assignment (current member, split) under which this member last raised
        its fence for it: a shard whose assignment changed since is held back until raised."""
        self._floor_wanted = 0
        """A ticket's counter the loop could not raise to at once (the node's thread does)."""
        self._tickets: AskTickets | None = None
        self._current: frozenset[int] = frozenset()
        """The shards this member was current member of at the last decision."""
        self._renewals: bool | None = None
        self._next_join = 0.0
        self._updates = 0  # views the member reported (its watch's thread adds)
        self._seen_updates = -1
        self._rest_until = 0.0
        """Until when, with no news, a step decides nothing new (``inf``: nothing waits on time
        or on holders; a failover wait: when the first is due; 0 while shards move out, whose
        holders are looked at each step)."""
        self.fenced_reason: str | None = "not started"
        self.clock = ClockSkew(advertise)
        """What the tickets it checks say of its wall clock (``clockskew``)."""
        self._handover = Handover(
            etcd_client,
            prefix,
            advertise,
            host,
            max_lease_ttl_s=max_lease_ttl_s,
            failover_margin_s=failover_margin_s,
        )

    @property
    def ownership(self) -> ClusterOwnership:
        """The current snapshot (immutable; replaced whole)."""
        return self._ownership

    def _hand(self, ownership: ClusterOwnership) -> None:
        """Make ``ownership`` the current snapshot, the host's too, before anything acts on it."""
        self._ownership = ownership
        self.host.set_ownership(ownership)

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

    @property
    def handovers(self) -> int:
        return self._handover.handovers

    @property
    def failovers(self) -> int:
        return self._handover.failovers

    @property
    def released_takeovers(self) -> int:
        return self._handover.released_takeovers

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
            fenced_reason=self.fenced_reason if fenced else None,
            clock_offset_s=self.clock.offset_s,
            clock_off=self.clock.off,
            clock_peer=self.clock.issuer,
            stale_tickets=self.clock.stale_tickets,
        )

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> ClusterNode:
        """Join (raises ``EtcdError`` when etcd cannot be reached) and start deciding."""
        if self._fence is None:
            store = EtcdCeilingStore(self.client, self.prefix, self.advertise)
            self._fence = FenceCounter(store=store)
        self._tickets = load_ask_tickets(self.client, self.prefix)
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
                self._handover.release(member, frozenset(keep), self.fence, self._clock())
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
        self._hand(self._fenced_snapshot(self._ownership.view))

    def _new_member(self) -> Member:
        return Member(
            self.client,
            self.prefix,
            self.advertise,
            lease_ttl=self.lease_ttl_s,
            settle_s=self.settle_s,
            auto_rebalance_s=self.auto_rebalance_s,
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
            self.step()

    def step(self) -> None:
        """One step of the node's thread: decide, publish, move shards (see the module's
        docstring). A node never ``start``-ed is driven by calls of this alone, with no thread
        of its own nor of its member's (a simulated member: tests/sim); it then joins at its
        first step, and its member is driven by its driver (``Member.keep_alive_step``,
        ``Member.step``). An etcd that does not answer leaves the work for the next step."""
        try:
            if self._tickets is None and self._thread is None:
                self._tickets = load_ask_tickets(self.client, self.prefix)
            self._raise_wanted_floor()
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
        if updates == self._seen_updates and now < self._rest_until:
            return  # a keep-alive alone: the snapshot reads the lease's deadline live
        self._seen_updates = updates
        view = member.snapshot()
        if self.advertise not in view.members:
            # Its key is gone (its lease revoked, or expired unnoticed): the others may already
            # count the wait for a failover. Grant nothing from now on; join again.
            self._self_fence("this member's key vanished from etcd")
            self._next_join = now + REJOIN_RETRY_S
            self._rejoin(member)
            return
        self._note_gone(view)
        decision = self._decide(view, now)
        if decision.failover_due:
            # The gone members' published longest leases read again before their shards are
            # taken (between, the wait runs on what was read when they were seen gone).
            decision = self._decide(view, now, fresh_waits=True)
        self._publish(view, decision, valid_until)
        self._fail_waiters_of_lost_shards(decision)
        shard_map = view.shard_map
        under = {s: (shard_map[s].current, shard_map[s].split) for s in decision.granting}
        if any(self._raised.get(s) != a for s, a in under.items()):
            # A shard gained, or whose assignment changed (a handover, a split, an unsplit):
            # above every ceiling another member published, so above all tokens ever granted
            # for these shards (its own are below its counter). Until then they stay held back.
            self.fence.raise_to(highest_ceiling(self.client, self.prefix, self.advertise))
            self._raised = under
            decision = self._decide(view, now)
            self._publish(view, decision, valid_until)
        else:
            self._raised = under
        self._allow_renewals(True)
        self._failover_since = dict(decision.failover_since)
        self._rest_until = 0.0 if decision.moving_out else decision.next_due
        self._handover.move_out(view, member, decision, self.fence)
        self._handover.unsplit(view, member, now, self._gone_at)
        if decision.failover_due:
            again = self._handover.take_over(view, member, decision.failover_due, self._gone_at)
            if again:
                self._wait_again(view, again)

    def _note_gone(self, view: ClusterView) -> None:
        """Keep ``_gone_at`` for the members the map names that are not live (first seen)."""
        live, gone_at = view.members, self._gone_at
        named = {n for _, a in view.shard_map.items() for n in (a.current, a.split) if n}
        self._gone_at = {n: gone_at.get(n, view.revision) for n in named - live}

    def _wait_again(self, view: ClusterView, members: set[str]) -> None:
        """etcd refused to let this member take these gone members' shards: each registered
        again after this member first saw it gone (a life its view missed, or one going on;
        ``Handover._write_while_gone``), or this member's own etcd lease is gone (it fences
        itself at its next step). Their shards' waits start again, as if seen gone now."""
        log.warning(
            "cluster member %s: taking the shards of %s refused: registered again since it was "
            "seen gone (or this member's etcd lease is gone); waiting its longest lease again",
            self.advertise,
            ", ".join(sorted(members)),
        )
        shard_map = view.shard_map
        self._failover_since = {
            s: t for s, t in self._failover_since.items() if shard_map[s].current not in members
        }
        self._gone_at = {m: r for m, r in self._gone_at.items() if m not in members}
        self._rest_until = 0.0

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

    def _decide(self, view: ClusterView, now: float, *, fresh_waits: bool = False) -> Decision:
        """The decision, holding back the shards not yet covered by a raised fence."""
        return decide(
            view,
            self.advertise,
            now=now,
            failover_since=self._failover_since,
            failover_wait_s=self.failover_wait_s,
            cleared=self._cleared(view),
            failover_waits=self._handover.failover_waits(view, fresh=fresh_waits),
        )

    def _cleared(self, view: ClusterView) -> frozenset[int]:
        """The shards whose fence was raised under the assignment the view shows."""
        shard_map = view.shard_map
        return frozenset(
            s
            for s, (current, split) in self._raised.items()
            if s in shard_map and (a := shard_map[s]).current == current and a.split == split
        )

    def _raise_floor(self, floor: int) -> bool:
        """On the loop: every token from now on above ``floor`` (an ask ticket's counter), at
        once when that needs no etcd write; else the node's thread raises it (False)."""
        if self.fence.raise_within(floor):
            return True
        self._floor_wanted = max(self._floor_wanted, floor)
        self._wake.set()
        return False

    def _raise_wanted_floor(self) -> None:
        wanted = self._floor_wanted
        if wanted > self.fence.last:
            self.fence.raise_to(wanted)

    # -- publishing ------------------------------------------------------------------------------

    def _publish(self, view: ClusterView, decision: Decision, valid_until: float) -> None:
        current = decision.serving.union(*decision.moving_out.values())
        member = self._member
        own = ClusterOwnership(
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
            tickets=self._tickets,
            fence_last=lambda: self.fence.last,
            raise_floor=self._raise_floor,
            wall=self._wall,
            clock_seen=self.clock.seen,
        )
        self._hand(own)
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
            self._hand(self._fenced_snapshot(self._ownership.view))
            self._current = frozenset()
            # On the loop, after the fenced snapshot is in place: no waiter is queued later.
            self.host.fail_waiters(range(SHARD_COUNT), ERROR_UNAVAILABLE)
        self._allow_renewals(False)
        if self.fenced_reason is None:
            log.warning("cluster member %s: fenced, granting nothing: %s", self.advertise, reason)
        self.fenced_reason = reason
        self._failover_since = {}
        self._gone_at = {}
        self._raised = {}
        self._handover.forget()
        self._seen_updates = -1
        self._rest_until = 0.0

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
            member = self._new_member()
            if self._thread is not None:
                member.start()
            elif not member.join_once():  # stepped (``step``): one attempt per step
                return
        except EtcdError as exc:
            log.debug("cluster member %s: cannot join again yet: %s", self.advertise, exc)
            return
        self._member = member
        log.warning("cluster member %s: joined again (lease %x)", self.advertise, member.lease_id)
        self._wake.set()
