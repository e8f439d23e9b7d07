"""The cluster member inside a lock server: decides, safely, which keys this server serves.

A ``ClusterNode`` runs a ``membership.Member`` and a thread that, on every change of the view
or the lease, and every ``NODE_TICK_S``:

1. asks ``decide.decide`` (pure) what each shard is and hands the verdicts to its server as an
   immutable ``snapshot.ClusterOwnership`` (``NodeHost.set_ownership``) before acting on them;
2. before granting on a shard under an assignment (current member, split) it did not grant
   under a moment ago, raises its fencing counter above the highest ceiling any member
   published (``<prefix>/fence/<member>``, outside the members' leases so a dead member's
   survives), so every token it grants is above every previous owner's; until then the shard
   answers ``error_unavailable``. A key asked for during a split is granted only above the
   counter signed into its ask ticket (``asktickets``);
3. splits shards moving out while keys are held or queued here, hands them over once none is
   (``handover``);
4. takes the shards of a gone member after the failover wait (at once when released).

Self-fencing: from ``Member.lease_valid_until`` on (the last answered keep-alive's send time +
the TTL: the lease surely lives until then), or once its own member key vanishes, the node
refuses every acquire, calls ``NodeHost.renewals_allowed(False)`` and joins again with a new
lease. The snapshot reads that deadline live, so even a paused process grants nothing late.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
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

NODE_TICK_S = 0.1  # how often the node looks again without news
FAILOVER_MARGIN_S = 1.0  # added to the longest lease at failover: clock rates, a tick, etcd delays
NODE_QUIET_S = 0.02  # news is decided once quiet this long (a map being written is a burst)...
NODE_MAX_DEFER_S = 0.25  # ...or once deferred this long


def boottime() -> float:
    """A clock that counts suspend (``CLOCK_BOOTTIME``, else monotonic): a member whose machine
    slept past its etcd lease must see that lease as over when it wakes."""
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    return time.monotonic() if clock_id is None else time.clock_gettime(clock_id)


def ask_secret_key(prefix: str) -> str:
    return prefix + "/asksecret"


def load_ask_tickets(client: EtcdClient, prefix: str) -> AskTickets:
    """The cluster's ask tickets, their secret created in etcd by a conditional put if absent."""
    key = ask_secret_key(prefix)
    kv = client.get(key)
    if kv is None:
        client.create_if_absent(key, new_secret())
        kv = client.get(key)
        if kv is None:
            raise EtcdError(f"the cluster's ask secret {key!r} vanished while being created")
    return AskTickets(kv.value.strip())


AUTO_REBALANCE_S = 10.0  # the leader evens the members out once membership is still this long
REJOIN_RETRY_S = 0.5


@dataclass(frozen=True, slots=True)
class ClusterStats:
    """What the metrics report about a cluster member (``ClusterNode.stats``)."""

    shards: Mapping[str, int]  # shards per state (decide.SHARD_STATES), adding up to SHARD_COUNT
    fenced: bool
    leader: bool
    handovers: int  # shards handed over (to their target, or released on a graceful leave)
    failovers: int  # shards taken after waiting out a gone member's longest lease
    released_takeovers: int  # shards taken at once because their member had released them
    etcd_switches: int = 0
    etcd_step_failures: int = 0  # the member loop's steps etcd failed, over all its lives
    fenced_reason: str | None = None
    clock_offset_s: float = 0.0  # ClockSkew.offset_s; clock_off, clock_peer, stale_tickets alike
    clock_off: bool = False
    clock_peer: str = ""
    stale_tickets: int = 0


class ClusterNode:
    """One lock server's cluster member; ``start`` then ``stop``. It owns the server's
    ``fence`` counter. ``max_lease_ttl_s`` and ``lease_ttl_s`` come checked (``Config``)."""

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
        self.client = etcd_client
        self.prefix = prefix
        self.advertise = advertise
        self.host = host
        self.lease_ttl_s = lease_ttl_s
        self.settle_s = settle_s
        self.auto_rebalance_s = auto_rebalance_s
        self.failover_wait_s = max_lease_ttl_s + failover_margin_s
        """The wait for a gone member that published no longest lease."""
        self._clock = clock
        self._wall = wall
        self._fence = fence
        self.member: Member | None = None  # the current member (a new one at each join)
        self._step_failures_before = 0  # step_failures of this node's earlier members
        # The server grants nothing until the first decision:
        self._hand(self._fenced_snapshot(ClusterView(frozenset(), None, ShardMap())))
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Owned by the node's thread (and ``_forget``'s):
        self._floor_wanted = 0  # a ticket's counter the loop could not raise to (the thread will)
        self._tickets: AskTickets | None = None
        self._renewals: bool | None = None
        self._next_join = 0.0
        self._updates = 0  # views the member reported (its watch's thread adds)
        self.fenced_reason: str | None = "not started"
        self.clock = ClockSkew(advertise)
        self._handover = Handover(
            etcd_client,
            prefix,
            advertise,
            host,
            max_lease_ttl_s=max_lease_ttl_s,
            failover_margin_s=failover_margin_s,
        )
        self._forget()

    def _forget(self) -> None:
        """What the node's thread learnt from the views it saw (forgotten once fenced)."""
        self._failover_since: dict[int, float] = {}
        self._gone_at: dict[str, int] = {}
        """Each member the map names, not live -> the revision of the first view showing it so."""
        self._raised: dict[int, tuple[str, str]] = {}
        """Shard -> the (current, split) under which this member last raised its fence for it."""
        self._seen_updates = -1
        self._rest_until = 0.0  # no news: no new decision until then (0 while shards move out)
        self._handover.forget()

    def _hand(self, ownership: ClusterOwnership) -> None:
        """Serve by ``ownership`` (immutable) from now on, in the node and in its server."""
        self.ownership = ownership
        self.host.set_ownership(ownership)

    @property
    def fence(self) -> FenceCounter:
        if self._fence is None:
            raise RuntimeError("the cluster node has no fence counter before start()")
        return self._fence

    def publish_longest(self, longest: int) -> None:
        """Store the longest lease this member may have granted, before granting a longer one
        (``FenceStateError`` when it cannot: the lease is then refused)."""
        EtcdLongestStore(self.client, self.prefix, self.advertise).write(longest)

    def stats(self) -> ClusterStats:
        own = self.ownership
        fenced = not own.alive()
        member = self.member
        return ClusterStats(
            shards=FENCED.states if fenced else own.states,
            fenced=fenced,
            leader=not fenced and member is not None and member.is_leader,
            handovers=self._handover.handovers,
            failovers=self._handover.failovers,
            released_takeovers=self._handover.released_takeovers,
            etcd_switches=self.client.switches,
            etcd_step_failures=self._step_failures_before
            + (0 if member is None else member.step_failures),
            fenced_reason=self.fenced_reason if fenced else None,
            clock_offset_s=self.clock.offset_s,
            clock_off=self.clock.off,
            clock_peer=self.clock.issuer,
            stale_tickets=self.clock.stale_tickets,
        )

    def start(self) -> ClusterNode:
        """Join (raises ``EtcdError`` when etcd cannot be reached) and start deciding."""
        if self._fence is None:
            store = EtcdCeilingStore(self.client, self.prefix, self.advertise)
            self._fence = FenceCounter(store=store)
        self._tickets = load_ask_tickets(self.client, self.prefix)
        self.member = self._new_member().start()
        self._thread = threading.Thread(
            target=self._run, name=f"dflockd-node {self.advertise}", daemon=True
        )
        self._thread.start()
        self._wake.set()
        return self

    def stop(self, *, leave: bool = True, timeout: float = 10.0) -> None:
        """Stop deciding, then leave (``leave``: release the shards nobody holds, then revoke
        the lease) or let the lease run out (a crash)."""
        self.halt(timeout)
        member, self.member = self.member, None
        if member is None:
            return
        if leave:
            try:
                self._handover.release(member, self.fence, self._clock())
            except (EtcdError, FenceStateError) as exc:
                log.warning(
                    "cluster member %s: cannot release its shards (%s): they wait for the failover",
                    self.advertise,
                    exc,
                )
        member.stop(leave=leave, timeout=timeout)

    def halt(self, timeout: float = 10.0) -> None:
        """Stop deciding, still a member: called before the server closes the connections of
        holders its shutdown timeout cut off, so no handover follows their closes."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._hand(self._fenced_snapshot(self.ownership.view))

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

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(NODE_TICK_S)
            self._wake.clear()
            if self._stopping.is_set():
                return
            self._let_news_settle()
            self.step()

    def step(self) -> None:
        """One step: decide, publish, move shards. A node never ``start``-ed is driven by this
        alone (tests/sim): it joins at its first step. An etcd error waits for the next step."""
        try:
            if self._tickets is None:  # (``start`` loads them before starting the thread)
                self._tickets = load_ask_tickets(self.client, self.prefix)
            if self._floor_wanted > self.fence.last:
                self.fence.raise_to(self._floor_wanted)
            self._step()
        except (EtcdError, FenceStateError) as exc:
            log.warning("cluster member %s: %s (trying again)", self.advertise, exc)
        except Exception:
            log.exception("cluster member %s: unexpected error", self.advertise)

    def _let_news_settle(self) -> None:
        deadline = self._clock() + NODE_MAX_DEFER_S
        seen = self._updates
        while seen != self._seen_updates and self._clock() < deadline:
            if self._stopping.wait(NODE_QUIET_S) or self._updates == seen:
                return
            seen = self._updates

    def _step(self) -> None:
        member = self.member
        now = self._clock()
        valid_until = 0.0 if member is None else member.lease_valid_until
        reason = None if member is None else member.lost
        if member is not None and reason is None and now >= member.lease_valid_until:
            reason = f"etcd lease not renewed for {self.lease_ttl_s} s"
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
            # Its key is gone: the others may already count the wait for a failover.
            self._self_fence("this member's key vanished from etcd")
            self._next_join = now + REJOIN_RETRY_S
            self._rejoin(member)
            return
        named = {n for _, a in view.shard_map.items() for n in (a.current, a.split) if n}
        self._gone_at = {n: self._gone_at.get(n, view.revision) for n in named - view.members}
        decision = self._decide(view, now)
        if decision.failover_due:
            # The gone members' published longest leases are read again before taking.
            decision = self._decide(view, now, fresh_waits=True)
        current = self.ownership.current
        self._publish(view, decision, valid_until)
        self._fail_waiters_of_lost_shards(current, decision)
        shard_map = view.shard_map
        under = {s: (shard_map[s].current, shard_map[s].split) for s in decision.granting}
        if any(self._raised.get(s) != a for s, a in under.items()):
            # A shard gained or reassigned: above every ceiling another member published.
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

    def _wait_again(self, view: ClusterView, members: set[str]) -> None:
        """etcd refused the take-over of these gone members' shards (each registered again
        since seen gone, or this member's lease is gone): their waits start again."""
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

    def _fail_waiters_of_lost_shards(self, was: frozenset[int], decision: Decision) -> None:
        """Answer the queued waiters of the shards of ``was`` no longer this member's."""
        by_reply: dict[bytes, list[int]] = {}
        for shard in sorted(was - self.ownership.current):
            if (reply := decision.verdicts[shard]) is not None:
                by_reply.setdefault(reply, []).append(shard)
        for reply, shards in by_reply.items():
            self.host.fail_waiters(shards, reply)

    def _decide(self, view: ClusterView, now: float, *, fresh_waits: bool = False) -> Decision:
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
        """On the loop: tokens from now on above ``floor``; False when that needs an etcd
        write (the node's thread does it)."""
        if self.fence.raise_within(floor):
            return True
        self._floor_wanted = max(self._floor_wanted, floor)
        self._wake.set()
        return False

    def _publish(self, view: ClusterView, decision: Decision, valid_until: float) -> None:
        member = self.member
        own = ClusterOwnership(
            self.advertise,
            view,
            decision.verdicts,
            valid_until,
            self._clock,
            decision.states,
            current=decision.serving.union(*decision.moving_out.values()),
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
        """Grant and renew nothing, fail every queued waiter, forget what was seen."""
        if not self.ownership.fenced:
            self._hand(self._fenced_snapshot(self.ownership.view))
            # After the fenced snapshot is in place: no waiter is queued later.
            self.host.fail_waiters(range(SHARD_COUNT), ERROR_UNAVAILABLE)
        self._allow_renewals(False)
        if self.fenced_reason is None:
            log.warning("cluster member %s: fenced, granting nothing: %s", self.advertise, reason)
        self.fenced_reason = reason
        self._forget()

    def _rejoin(self, old: Member | None) -> None:
        """Join again under a new lease, from a fresh read."""
        if old is not None:
            old.stop(leave=False)
            self._step_failures_before += old.step_failures
            if old.lease_id:
                # Its keys go first: the member key is registered anew only if free.
                with contextlib.suppress(EtcdError):
                    self.client.lease_revoke(old.lease_id)
        self.member = None
        try:
            member = self._new_member()
            if self._thread is not None:
                member.start()
            elif not member.join_once():  # stepped (``step``): one attempt per step
                return
        except EtcdError as exc:
            log.debug("cluster member %s: cannot join again yet: %s", self.advertise, exc)
            return
        self.member = member
        log.warning("cluster member %s: joined again (lease %x)", self.advertise, member.lease_id)
        self._wake.set()
