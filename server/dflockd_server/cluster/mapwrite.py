"""Writing shard assignments to etcd, each on condition that nobody changed it meanwhile.

Every writer of the map (the leader's upkeep, a member completing a handover or a failover, an
operator's rebalance or pin) reads a shard's value with its ``mod_revision`` and writes only if
the key is still at that revision (``0``: only if the key still does not exist). A concurrent
write therefore makes the later writer fail for that shard instead of clobbering it; the
writer reads again and decides again.

Writes go in transactions of at most ``MAX_TXN_OPS`` comparisons (etcd's limit counts them
too), one of which may be an extra condition (e.g. "still the leader"). When a batch fails, its
shards are retried one transaction each, so one changed shard does not hold back the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dflockd_server.cluster.etcd import MAX_TXN_OPS, Compare, Delete, EtcdClient, Op, Put
from dflockd_server.cluster.shardmap import ShardAssignment


@dataclass(frozen=True, slots=True)
class ShardWrite:
    """The new assignment of one shard (``None``: delete its key), if it is still at
    ``revision`` (its ``mod_revision`` when read; 0 when it had no key)."""

    revision: int
    assignment: ShardAssignment | None


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: Mapping[int, int]
    """Shard -> the revision of its write (its new ``mod_revision``; a delete's revision)."""
    conflicted: tuple[int, ...]
    """Shards changed by someone else since they were read (read again, decide again)."""
    condition_failed: bool = False
    """The extra condition did not hold: nothing more was written."""


def shard_key(shards_prefix: str, shard: int) -> str:
    return f"{shards_prefix}{shard}"


def _unchanged(key: str, revision: int) -> Compare:
    if revision == 0:
        return Compare(key, "CREATE", "EQUAL", 0)
    return Compare(key, "MOD", "EQUAL", revision)


def _op(key: str, assignment: ShardAssignment | None) -> Op:
    return Delete(key) if assignment is None else Put(key, assignment.format())


def write_shards(
    client: EtcdClient,
    shards_prefix: str,
    writes: Mapping[int, ShardWrite],
    *,
    condition: Compare | None = None,
) -> WriteResult:
    """Write each shard whose key is still at its revision (see the module's docstring).

    Raises ``EtcdError`` when etcd cannot be reached (what was written before stays written).
    """
    extra = [] if condition is None else [condition]
    per_batch = MAX_TXN_OPS - len(extra)
    items = sorted(writes.items())
    written: dict[int, int] = {}
    conflicted: list[int] = []
    for start in range(0, len(items), per_batch):
        batch = items[start : start + per_batch]
        keyed = [(s, shard_key(shards_prefix, s), w) for s, w in batch]
        compares = [*extra, *(_unchanged(k, w.revision) for _, k, w in keyed)]
        result = client.txn(compares, [_op(k, w.assignment) for _, k, w in keyed])
        if result.succeeded:
            written.update((s, result.revision) for s, _, _ in keyed)
            continue
        for s, k, w in keyed:
            one = client.txn([*extra, _unchanged(k, w.revision)], [_op(k, w.assignment)])
            if one.succeeded:
                written[s] = one.revision
            elif condition is not None and not client.txn([condition], []).succeeded:
                return WriteResult(written, tuple(conflicted), condition_failed=True)
            else:
                conflicted.append(s)
    return WriteResult(written, tuple(conflicted))
