"""``ClusterOwnership``: one immutable snapshot of a cluster member's verdicts.

The server's loop thread calls ``check`` before an acquire-type request touches the table and
before the table promotes a queued waiter, ``may_hold`` before a renewal, a take-over
(``ht``) or a hand-down (``hd``) of a held grant, and ``describe`` for the ``shards``
request. The cluster node
builds a new snapshot whenever its view or its lease changes and swaps the reference; nothing
here is ever mutated.

Besides the per-shard verdicts a snapshot carries ``valid_until``: the time (on the node's
monotonic clock) until which this member's etcd lease surely lives. Past it the snapshot
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

    def check(self, key: str) -> bytes | None:
        if self.fenced or self.clock() >= self.valid_until:
            return ERROR_UNAVAILABLE
        return self.verdicts[shard_id(key)]

    def may_hold(self, key: str) -> bool:
        return not self.fenced and self.clock() < self.valid_until and shard_id(key) in self.current

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
