"""``ClusterOwnership``: one immutable snapshot of a cluster member's verdicts.

The server's loop calls ``check`` before an acquire-type request touches the table and before
the table promotes a queued waiter, ``may_hold`` before a renewal, a take-over (``ht``) or a
hand-down (``hd``), and ``describe`` for the ``shards`` request. The node swaps in a new
snapshot whenever its view changes. Past ``valid_until`` (or the live ``lease_until``) it
answers as a fenced member does, even before the node's threads notice (``node``). Key-level
moves carry proof: ``error_ask <node> <ticket>`` and ``admit_ask`` (``asktickets``).
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
    """The contract's ``Ownership`` in cluster mode."""

    me: str
    view: ClusterView
    verdicts: tuple[bytes | None, ...]
    valid_until: float
    clock: Callable[[], float]
    states: Mapping[str, int] = field(default_factory=lambda: FENCED.states)
    fenced: bool = False
    current: frozenset[int] = frozenset()
    """The shards whose current member this one is: the only ones whose grants it may renew,
    take over or hand down."""
    holding: frozenset[int] = frozenset()
    importing: frozenset[int] = frozenset()
    present: Callable[[str], bool | None] | None = None
    """Whether the table holds or queues anything on a key (None: cannot tell). On the loop."""
    lease_until: Callable[[], float] | None = None
    """The lease deadline read live, so a node thread busy with a long etcd write does not
    make its member look fenced (no one can take its shards while its lease lives)."""
    tickets: AskTickets | None = None
    fence_last: Callable[[], int] | None = None
    raise_floor: Callable[[int], bool] | None = None
    """Tokens from now on above the given counter; False when the node's thread must do it."""
    wall: Callable[[], float] = time.time
    clock_seen: Callable[[float, str], None] | None = None
    """Told each genuine ticket's clock offset and issuer (the node's ``ClockSkew``)."""

    def alive(self) -> bool:
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
        """``error_ask <split node> <ticket>``: this member lets ``key`` go for the split."""
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
        """None when this member may grant ``key`` to the acquire after this ``asking``: the
        shard is split here, the ticket is genuine for this key and split, unexpired, and the
        fencing counter is above its floor; else ``error`` (the client routes again)."""
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
        """``check`` for an acquire after an admitted ``asking`` of this key."""
        return None if self.alive() and shard_id(key) in self.importing else self.check(key)

    def may_hold(self, key: str) -> bool:
        shard = shard_id(key)
        return (shard in self.current or shard in self.importing) and self.alive()

    def describe(self) -> dict[str, object]:
        shard_map = self.view.shard_map
        items = shard_map.items()
        nodes = sorted({n for _, a in items for n in (a.target, a.current, a.split) if n})
        index = {n: i for i, n in enumerate(nodes)}
        current, target, split = [-1] * SHARD_COUNT, [-1] * SHARD_COUNT, [-1] * SHARD_COUNT
        for shard, a in items:
            target[shard] = index[a.target]
            current[shard] = index.get(a.current, -1)
            split[shard] = index.get(a.split, -1)
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
            "split": split,
            "pinned": shard_map.pinned_shards(),
            "moving": shard_map.moves_in_progress(),
        }
