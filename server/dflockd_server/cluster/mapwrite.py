"""Shard assignments written to etcd, each only if nobody changed it since it was read.

Each write is conditioned on the shard key's ``mod_revision`` as read (``0``: still absent): a
concurrent write makes the later writer fail for that shard instead of clobbering it. At most
``MAX_TXN_OPS`` comparisons go in one transaction, the extra conditions (e.g. "still the
leader") among them. A failed one reads the keys it compared in its failure branch: the shards
changed meanwhile are reported conflicted and the others written again at once, so a view stale
by thousands of shards costs one request per batch, not one per shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dflockd_server.cluster.etcd import MAX_TXN_OPS, Compare, Delete, EtcdClient, Get, Op, Put
from dflockd_server.cluster.shardmap import ShardAssignment


@dataclass(frozen=True, slots=True)
class ShardWrite:
    """The new assignment of one shard (``None``: delete its key), if it is still at
    ``revision`` (its ``mod_revision`` when read; 0 when it had no key)."""

    revision: int
    assignment: ShardAssignment | None


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: Mapping[int, int]  # shard -> its write's revision (new mod_revision; a delete's)
    conflicted: tuple[int, ...]  # shards changed by another since read (read, decide again)
    condition_failed: bool = False  # the extra condition did not hold: nothing more written


def _op(key: str, assignment: ShardAssignment | None) -> Op:
    return Delete(key) if assignment is None else Put(key, assignment.format())


def write_shards(
    client: EtcdClient,
    shards_prefix: str,
    writes: Mapping[int, ShardWrite],
    *,
    condition: Sequence[Compare] = (),
) -> WriteResult:
    """Write each shard whose key is still at its revision, if ``condition`` holds too.
    Raises ``EtcdError`` when etcd cannot be reached (what was written stays written)."""
    per_batch = MAX_TXN_OPS - len(condition)
    items = sorted(writes.items())
    written: dict[int, int] = {}
    conflicted: list[int] = []
    for start in range(0, len(items), per_batch):
        pending = [(s, f"{shards_prefix}{s}", w) for s, w in items[start : start + per_batch]]
        while pending:  # each failed round removes a changed shard, or ends the call
            result = client.txn(
                [*condition, *(Compare.unchanged(k, w.revision) for _, k, w in pending)],
                [_op(k, w.assignment) for _, k, w in pending],
                [Get(k) for _, k, _ in pending],
            )
            if result.succeeded:
                written.update((s, result.revision) for s, _, _ in pending)
                break
            now = {kv.key: kv.mod_revision for kvs in result.ranges for kv in kvs}
            changed = [s for s, k, w in pending if now.get(k, 0) != w.revision]
            if not changed:  # every shard as read: the extra condition failed
                return WriteResult(written, tuple(conflicted), condition_failed=True)
            conflicted.extend(changed)
            pending = [(s, k, w) for s, k, w in pending if now.get(k, 0) == w.revision]
    return WriteResult(written, tuple(sorted(conflicted)))
