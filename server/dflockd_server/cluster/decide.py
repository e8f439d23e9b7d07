"""What a cluster member does with each shard, decided from its view alone (pure, no I/O).

For every shard (``self``: the member's advertised address):

- **serve**: current == target == self (unless fenced, or held back until the fencing counter
  is raised).
- **moving out**, key by key (current == self, and target == other or flag ``split=<node>``,
  which only the handover to that node drops): keys held or queued here (``holding``) are
  still served; any other key is answered ``error_ask <split node>`` (``error_unavailable``
  until the split is written, or while its node is not live). A key asked for is never held
  or queued here again, and the split's node grants a key only to an ``asking`` acquire or
  while it holds or queues it (``importing``): the two never grant one key both. Once nothing
  is held here the member sets current = the split's node (else the target). A cancelled or
  changed target leaves the split: keys already asked for may be held there.
- **taking over**: target == self, current == another live member: ``error_unavailable``
  until it hands the shard over.
- **failover**: target == self, current empty or not live: ``error_unavailable`` until
  ``failover_wait_s`` has passed since this member first saw the current member gone (whatever
  the target then); then current = self (``failover_due``). A *released* shard is due at once.
- **other**: ``error_moved <current>`` (the target when current is empty).
- A shard with no assignment, and every shard while **fenced**, is ``error_unavailable``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Set
from dataclasses import dataclass
from types import MappingProxyType

from dflockd_server import protocol as p
from dflockd_server.cluster.membership import ClusterView
from dflockd_server.cluster.shardmap import SHARD_COUNT

ERROR_UNAVAILABLE = p.REPLY_ERROR_UNAVAILABLE

SHARD_STATES = ("serving", "moving_out", "taking_over", "failing_over", "other", "unavailable")
"""The ``state`` label of ``dflockd_cluster_shards`` (serving includes shards held back)."""


@dataclass(frozen=True, slots=True)
class Decision:
    verdicts: tuple[bytes | None, ...]  # per shard: None (serve) or the reply to an acquire
    serving: frozenset[int]  # shards this member would serve (held back too: not cleared)
    moving_out: Mapping[str, frozenset[int]]  # the split's node, else the target -> its shards
    failover_due: tuple[int, ...]  # the dead current's grants surely ended: set current = self
    failover_since: Mapping[int, float]  # when each current was first seen gone (pass it on)
    states: Mapping[str, int]  # shards per SHARD_STATES
    holding: frozenset[int] = frozenset()  # moving out (cleared): keys held or queued here served
    importing: frozenset[int] = frozenset()
    """Shards split to this member (cleared): it serves a key an ``asking`` acquire names, or
    one it holds or queues."""
    granting: frozenset[int] = frozenset()
    """Every shard on which this member may grant, cleared or not: the fencing counter must be
    raised above every published ceiling first."""
    next_due: float = math.inf  # first failover due: till then an unchanged view decides the same


FENCED = Decision(
    verdicts=(ERROR_UNAVAILABLE,) * SHARD_COUNT,
    serving=frozenset(),
    moving_out={},
    failover_due=(),
    failover_since={},
    states=MappingProxyType({**dict.fromkeys(SHARD_STATES, 0), "unavailable": SHARD_COUNT}),
)


def decide(
    view: ClusterView,
    me: str,
    *,
    now: float,
    failover_since: Mapping[int, float],
    failover_wait_s: float,
    cleared: Set[int] | None = None,
    failover_waits: Mapping[str, float] | None = None,
) -> Decision:
    """Every shard's verdict and what to do next. ``cleared``: if given, only these shards
    are served, the others held back. ``failover_waits``: per gone member, instead of
    ``failover_wait_s``."""
    live = view.members
    shard_map = view.shard_map
    moved = functools.cache(p.reply_moved)  # one reply object per address
    ask = functools.cache(p.reply_ask)
    holding: set[int] = set()
    importing: set[int] = set()
    importing_all: set[int] = set()

    verdicts: list[bytes | None] = [ERROR_UNAVAILABLE] * SHARD_COUNT
    serving: set[int] = set()
    moving: dict[str, set[int]] = {}
    due: list[int] = []
    since: dict[int, float] = {}
    taking_over = failing_over = 0
    next_due = math.inf
    for shard, a in shard_map.items():
        current, target, split = a.current, a.target, a.split
        if (not current or current not in live) and not a.released:
            # Whatever the target: the leader's batched new targets start no wait of their own.
            since[shard] = failover_since.get(shard, now)
        if current == me and target == me and not split:
            serving.add(shard)
            if cleared is None or shard in cleared:
                verdicts[shard] = None
            continue
        if current == me:
            moving.setdefault(split or target, set()).add(shard)
            if cleared is None or shard in cleared:
                holding.add(shard)
                if split and split in live:
                    verdicts[shard] = ask(split)
            continue  # else unavailable (but for the keys it holds or queues)
        if split == me and current:
            importing_all.add(shard)
            if cleared is None or shard in cleared:
                importing.add(shard)
        if target == me:
            if a.released:
                failing_over += 1
                due.append(shard)  # let go with nothing held: no lease to wait for
                next_due = min(next_due, now)
            elif not current or current not in live:
                failing_over += 1
                first = since[shard]
                wait = failover_wait_s
                if failover_waits and current:
                    wait = failover_waits.get(current, failover_wait_s)
                if now - first >= wait:
                    due.append(shard)
                next_due = min(next_due, first + wait)
            else:
                taking_over += 1
            if split != me or current not in live:
                continue  # unavailable: waiting for a handover, or for a failover
            elsewhere = current  # importing: the keys it was not asked for are the current's
        else:
            elsewhere = current or target
        verdicts[shard] = moved(elsewhere)
    for shard in importing_all - importing:
        verdicts[shard] = ERROR_UNAVAILABLE  # asked or not, until its fence is raised: a moment
    moving_out = sum(len(s) for s in moving.values())
    assigned = len(shard_map)
    other = assigned - len(serving) - moving_out - taking_over - failing_over
    counts = (len(serving), moving_out, taking_over, failing_over, other, SHARD_COUNT - assigned)
    states: dict[str, int] = dict(zip(SHARD_STATES, counts, strict=True))
    return Decision(
        verdicts=tuple(verdicts),
        serving=frozenset(serving),
        moving_out={t: frozenset(s) for t, s in sorted(moving.items())},
        failover_due=tuple(due),
        failover_since=since,
        states=states,
        holding=frozenset(holding),
        importing=frozenset(importing),
        granting=frozenset(serving.union(importing_all, *moving.values())),
        next_due=next_due,
    )
