"""``ClusterOwnership``: one immutable snapshot of a cluster member's verdicts.

The server's loop thread calls ``check`` before an acquire-type request touches the table and
before the table promotes a queued waiter, ``may_hold`` before a renewal, a take-over
(``ht``) or a hand-down (``hd``) of a held grant, and ``describe`` for the ``shards``
request. The cluster node
builds a new snapshot whenever its view or its lease changes and swaps the reference; nothing
here is ever mutated.

Besides the per-shard verdicts a snapshot carries ``valid_until``: the time (on the node's
clock, which counts suspend) until which this member's etcd lease surely lives, and reads the
member's own deadline live (``lease_until``) as its keep-alives move it on. Past it the snapshot
answers as a fenced member does even before the node's threads notice (a process paused for
longer than its lease, for instance), so no grant and no renewal can come from a member that
the others may already consider gone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dflockd_server.cluster.decide import ERROR_UNAVAILABLE, FENCED
from dflockd_server.cluster.membership import ClusterView
from dflockd_server.cluster.shardmap import SHARD_COUNT, shard_id

CLUSTER_MODE = "cluster"
HASH_NAME = "fnv1a32"


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
        return verdict

    def check_asked(self, key: str) -> bytes | None:
        """``check`` for an acquire after ``asking``: a shard split to this member serves it
        (the current member asked for it: it holds and queues nothing on it, and never will
        during this split)."""
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
            "mode": CLUSTER_MODE,
            "self": self.me,
            "leader": self.view.leader,
            "members": sorted(self.view.members),
            "shard_count": SHARD_COUNT,
            "hash": HASH_NAME,
            "nodes": nodes,
            "current": current,
            "target": target,
            "pinned": shard_map.pinned_shards(),
            "moving": shard_map.moves_in_progress(),
        }
