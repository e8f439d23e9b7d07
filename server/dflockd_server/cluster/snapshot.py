"""``ClusterOwnership``: one immutable snapshot of a cluster member's verdicts.

The server's loop thread calls ``check`` before an acquire-type request touches the table and
before the table promotes a queued waiter, ``may_hold`` before a renewal, a take-over
(``ht``) or a hand-down (``hd``) of a held grant, and ``describe`` for the ``shards``
request. The cluster node builds a new snapshot whenever its view changes and swaps the
reference; nothing here is ever mutated, and a keep-alive of the lease needs none.

Besides the per-shard verdicts a snapshot carries ``valid_until``: the time (on the node's
clock, which counts suspend) until which this member's etcd lease surely lives, and reads the
member's own deadline live (``lease_until``) as its keep-alives move it on. Past it the snapshot
answers as a fenced member does even before the node's threads notice (a process paused for
longer than its lease, for instance), so no grant and no renewal can come from a member that
the others may already consider gone.

Key-level moves carry proof (``asktickets``): a member moving a shard out answers an acquire of a
key it neither holds nor queues ``error_ask <node> <ticket>``, the ticket signed with the
cluster's ask secret and carrying its fencing counter; the importing member admits an ``asking``
only with such a ticket for that very key and move (``admit_ask``), and raises its own counter
above the ticket's before it grants.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dflockd_server import constants as c, protocol as p
from dflockd_server.cluster.asktickets import AskedKey, AskTickets
from dflockd_server.cluster.decide import ERROR_UNAVAILABLE, FENCED
from dflockd_server.cluster.membership import ClusterView
from dflockd_server.cluster.shardmap import SHARD_COUNT, shard_id


@dataclass(frozen=True, slots=True)
class ClusterOwnership:
    """The contract's ``Ownership`` in cluster mode (see the module's docstring)."""

    me: str
    view: ClusterView
    verdicts: tuple[bytes | None, ...]
    valid_until: float
    clock: Callable[[], float]
    states: Mapping[str, int] = field(default_factory=lambda: FENCED.states)
    """Shards per state of the decision (``decide.SHARD_STATES``), for the metrics."""
    fenced: bool = False
    current: frozenset[int] = frozenset()
    """The shards whose current member this one is (served, or moving out while their
    holders finish): the only ones whose grants it may renew, take over or hand down."""

    holding: frozenset[int] = frozenset()
    """Shards moving out key by key: a key held or queued here is served, any other gets the
    shard's verdict (``decide.Decision.holding``)."""
    importing: frozenset[int] = frozenset()
    """Shards split to this member: a key an ``asking`` acquire names, or one held or queued
    here, is served (``decide.Decision.importing``)."""
    present: Callable[[str], bool | None] | None = None
    """Whether the server's table holds or queues anything on a key (None: it cannot tell,
    before its table is made or during a restart grace). Called on the loop."""

    lease_until: Callable[[], float] | None = None
    """The member's lease deadline read live (its keep-alive thread moves it on), so a node
    thread busy with a long etcd write does not make its member look fenced: while this
    member's lease lives, no other member can take a shard it is the current member of, so
    the verdicts stay safe however old the snapshot."""

    tickets: AskTickets | None = None
    """The cluster's ask tickets (None: ``error_ask`` names no ticket and ``asking`` is
    refused)."""
    fence_last: Callable[[], int] | None = None
    """This member's fencing counter: every token it issued so far is at or below it."""
    raise_floor: Callable[[int], bool] | None = None
    """Make every token issued from now on exceed the given counter; False when that cannot be
    done at once on the loop (the node's thread does it: the acquire is refused meanwhile)."""
    wall: Callable[[], float] = time.time
    """The wall clock tickets' expiry is counted on."""
    clock_seen: Callable[[float, str], None] | None = None
    """Told, on the loop, how far this member's wall clock is from the issuer's (named) of
    each genuine ticket an ``asking`` brings (``Ticket.clock_offset``): the node's
    ``ClockSkew``."""

    def alive(self) -> bool:
        """Whether this member can show its etcd lease alive now."""
        if self.fenced:
            return False
        until = self.valid_until
        live = self.lease_until
        if live is not None:
            until = max(until, live())
        return self.clock() < until

    def check(self, key: str) -> bytes | None:
        if not self.alive():
            return ERROR_UNAVAILABLE
        shard = shard_id(key)
        verdict = self.verdicts[shard]
        if verdict is None or (shard not in self.holding and shard not in self.importing):
            return verdict
        present = self.present(key) if self.present is not None else None
        if present:
            return None  # held or queued here: it stays here until released
        if present is None and shard in self.holding:
            return ERROR_UNAVAILABLE  # not known to be free here: ask nobody for it
        if shard in self.holding and verdict != ERROR_UNAVAILABLE:
            return self._ask(key, shard, verdict)
        return verdict

    def _ask(self, key: str, shard: int, verdict: bytes) -> bytes:
        """``error_ask <split node> <ticket>``: this member lets ``key`` go for the rest of
        the split (it holds and queues nothing on it, and creates no key of this shard)."""
        tickets, fence_last = self.tickets, self.fence_last
        if tickets is None or fence_last is None:
            return verdict
        split = self.view.shard_map[shard].split
        ticket = tickets.issue(
            AskedKey(key, shard, self.me, split),
            revision=self.view.revisions.get(shard, 0),
            floor=fence_last(),
            now=self.wall(),
        )
        return p.reply_ask(split, ticket)

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        """An ``asking`` naming ``key`` and ``ticket``: None when this member may grant the key
        to the acquire that follows (its shard is split to this member, the ticket is the
        current member's for this key and this very split, unexpired, and this member's fencing
        counter is above the ticket's); else ``error``, the one refusal ``asking`` has (the
        client pauses, then routes by the map again)."""
        if not self.alive():
            return p.REPLY_ERROR
        shard = shard_id(key)
        tickets = self.tickets
        if shard not in self.importing or tickets is None:
            return p.REPLY_ERROR
        current = self.view.shard_map[shard].current
        got = tickets.genuine(ticket, AskedKey(key, shard, current, self.me))
        if got is None:
            return p.REPLY_ERROR
        now = self.wall()
        if self.clock_seen is not None and current:
            self.clock_seen(got.clock_offset(now), current)
        if now > got.expires or got.revision != self.view.revisions.get(shard, 0):
            return p.REPLY_ERROR
        raise_floor = self.raise_floor
        if raise_floor is not None and not raise_floor(got.floor):
            return p.REPLY_ERROR  # the node's thread raises it: the client asks again soon
        return None

    def check_asked(self, key: str) -> bytes | None:
        """``check`` for an acquire after an admitted ``asking`` (``admit_ask``) of this key:
        a shard split to this member serves it (the current member let it go: it holds and
        queues nothing on it, and never will during this split)."""
        if self.alive() and shard_id(key) in self.importing:
            return None
        return self.check(key)

    def may_hold(self, key: str) -> bool:
        shard = shard_id(key)
        return (shard in self.current or shard in self.importing) and self.alive()

    def describe(self) -> dict[str, object]:
        shard_map = self.view.shard_map
        items = shard_map.items()
        nodes = sorted({n for _, a in items for n in (a.target, a.current) if n})
        index = {n: i for i, n in enumerate(nodes)}
        current = [-1] * SHARD_COUNT
        target = [-1] * SHARD_COUNT
        for shard, a in items:
            target[shard] = index[a.target]
            current[shard] = index.get(a.current, -1)
        return {
            "mode": c.MODE_CLUSTER,
            "self": self.me,
            "leader": self.view.leader,
            "members": sorted(self.view.members),
            "shard_count": SHARD_COUNT,
            "hash": c.HASH_FNV1A32,
            "nodes": nodes,
            "current": current,
            "target": target,
            "pinned": shard_map.pinned_shards(),
            "moving": shard_map.moves_in_progress(),
        }
