"""What a cluster member does with each shard, decided from its view alone (pure, no I/O).

For every shard, from the member's view of the map and of the live members (``self`` is the
member's advertised address):

- **serve**: current == target == self (unless fenced, or held back until the fencing counter
  is raised).
- **moving out**, key by key (current == self, and target == other or the shard is *split*,
  flag ``split=<node>``, which only the handover to that node drops): the keys this member
  holds or queues (``holding``) are still served here, waiters promoted in order, renewals and
  releases go on; any other key is answered ``error_ask <split node>`` (``error_unavailable``
  until the member has written the split, or while the split's node is not live). A key is
  never asked for while held or queued here, and once asked for it is never held or queued
  here again (this member creates no key of a holding shard): so the split's node, which
  grants such a shard's key only to an ``asking`` acquire or while it holds or queues it
  itself (``importing``), and this member never grant one key both. Once nothing is held
  here, the member publishes its fence ceiling and sets current = the split's node (else the
  target), dropping the flag (``handover_due``). A cancelled or changed target leaves the
  split: the keys already asked for may be held there.
- **taking over**: target == self, current == another *live* member: ``error_unavailable``
  until that member hands the shard over.
- **failover**: target == self, current empty or a member that is not live:
  ``error_unavailable`` until ``failover_wait_s`` (the longest lock lease plus a margin) has
  passed since this member first saw the shard's current member gone, whatever its target was
  then (the dead member's grants have run out by then); then it sets current = self
  (``failover_due``). A shard *released* by a member that left gracefully (current empty, flag
  ``released``: nothing on it is held, and its fence ceiling was published first) is due at
  once.
- **other**: ``error_moved <current>`` (the target when current is empty).
- A shard with no assignment, and every shard while the member is **fenced** (its etcd lease
  cannot be shown alive), is ``error_unavailable``.

``Decision.states`` counts the shards in each state (``SHARD_STATES``) in the same pass, for
the metrics. The cluster node (``cluster.node``) calls this from its threads and carries out
the result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass
from types import MappingProxyType

from dflockd_server import protocol as p
from dflockd_server.cluster.membership import ClusterView
from dflockd_server.cluster.shardmap import SHARD_COUNT

ERROR_UNAVAILABLE = p.REPLY_ERROR_UNAVAILABLE
"""Nobody serves the key at this moment (transient): the protocol's reply."""

moved_reply = p.reply_moved
"""The reply that sends a client to another member: the protocol's ``error_moved``."""


SERVING = "serving"
MOVING_OUT = "moving_out"
TAKING_OVER = "taking_over"
FAILING_OVER = "failing_over"
OTHER = "other"
UNAVAILABLE = "unavailable"
SHARD_STATES = (SERVING, MOVING_OUT, TAKING_OVER, FAILING_OVER, OTHER, UNAVAILABLE)
"""The ``state`` label of ``dflockd_cluster_shards``, as in the module's docstring; serving
includes a shard held back until the fence is raised, failing over one that is due."""


@dataclass(frozen=True, slots=True)
class Decision:
    verdicts: tuple[bytes | None, ...]
    """Per shard: None (serve) or the reply to an acquire instead."""
    serving: frozenset[int]
    """Shards this member would serve (including those held back: not ``cleared``)."""
    moving_out: Mapping[str, frozenset[int]]
    """Destination (the split's node, else the target) -> the shards moving out to it."""
    failover_due: tuple[int, ...]
    """Shards whose dead current member's grants have surely run out: set current = self."""
    failover_since: Mapping[int, float]
    """When this member first saw each shard's current member gone (or none), whatever the
    target (pass to the next call)."""
    states: Mapping[str, int]
    """How many shards are in each of ``SHARD_STATES`` (they add up to ``SHARD_COUNT``)."""
    holding: frozenset[int] = frozenset()
    """Shards moving out (cleared): keys held or queued here are still served; any other key
    gets the shard's verdict."""
    importing: frozenset[int] = frozenset()
    """Shards split to this member (cleared): it serves a key an ``asking`` acquire names, or
    one it holds or queues; any other key gets the shard's verdict."""
    granting: frozenset[int] = frozenset()
    """Every shard on which this member may grant (served, holding, importing; cleared or not):
    the fencing counter must be raised above every published ceiling before."""
    next_due: float = math.inf
    """When the first awaited failover is due (``now``'s clock; ``inf`` if none): until then,
    with an unchanged view, deciding again gives the same."""


FENCED = Decision(
    verdicts=(ERROR_UNAVAILABLE,) * SHARD_COUNT,
    serving=frozenset(),
    moving_out={},
    failover_due=(),
    failover_since={},
    states=MappingProxyType({**dict.fromkeys(SHARD_STATES, 0), UNAVAILABLE: SHARD_COUNT}),
)
"""A member that lost (or cannot show) its etcd lease grants nothing and plans nothing."""


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
    """Every shard's verdict and what to do next.

    ``failover_since``: the previous decision's (empty after a start or rejoin: the wait counts
    from what this member saw itself). ``cleared``: if given, only these shards are served; the
    others are held back (``error_unavailable``) until the fencing counter is above the previous
    owners' ceilings. ``failover_waits``: per gone member, its published longest lease plus the
    margin, used instead of ``failover_wait_s``.
    """
    live = view.members
    shard_map = view.shard_map
    moved: dict[str, bytes] = {}
    ask: dict[str, bytes] = {}
    holding: set[int] = set()
    holding_all: set[int] = set()
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
            # Whatever the target: the leader's new targets, written in batches, start no wait
            # of their own (one gone member's shards are due together).
            since[shard] = failover_since.get(shard, now)
        if current == me and target == me and not split:
            serving.add(shard)
            if cleared is None or shard in cleared:
                verdicts[shard] = None
            continue
        if current == me:
            # Moving out: held or queued keys stay; the others are asked at the split's node
            # once the split is written, unavailable before.
            dest = split or target
            moving.setdefault(dest, set()).add(shard)
            holding_all.add(shard)
            if cleared is None or shard in cleared:
                holding.add(shard)
                if split and split in live:
                    reply = ask.get(split)
                    if reply is None:
                        reply = ask[split] = p.reply_ask(split)
                    verdicts[shard] = reply
            continue  # else unavailable (but for the keys it holds or queues)
        if split == me and current:
            # Importing: serves the keys the current member asked it for (and then holds).
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
        reply = moved.get(elsewhere)
        if reply is None:
            reply = moved[elsewhere] = moved_reply(elsewhere)
        verdicts[shard] = reply
    for shard in importing_all - importing:
        verdicts[shard] = ERROR_UNAVAILABLE  # asked or not, until its fence is raised: a moment
    moving_out = sum(len(s) for s in moving.values())
    assigned = len(shard_map)
    states = {
        SERVING: len(serving),
        MOVING_OUT: moving_out,
        TAKING_OVER: taking_over,
        FAILING_OVER: failing_over,
        OTHER: assigned - len(serving) - moving_out - taking_over - failing_over,
        UNAVAILABLE: SHARD_COUNT - assigned,
    }
    return Decision(
        verdicts=tuple(verdicts),
        serving=frozenset(serving),
        moving_out={t: frozenset(s) for t, s in sorted(moving.items())},
        failover_due=tuple(due),
        failover_since=since,
        states=states,
        holding=frozenset(holding),
        importing=frozenset(importing),
        granting=frozenset(serving | holding_all | importing_all),
        next_due=next_due,
    )


def handover_due(moving_out: Set[int], still_held: Set[int]) -> frozenset[int]:
    """The shards moving out that no holder keeps any more: hand them over now."""
    return frozenset(moving_out) - frozenset(still_held)
