"""A lock cluster whose membership can change: the shard map and its etcd store.

- ``shardmap`` (pure): shard ids, the value format, initial map, updates, pins, rebalance plans;
- ``etcd/``: a small standard-library client for etcd v3's JSON gateway (``client``: keys,
  transactions, leases, watches; ``transport``: endpoints, fail-over, TLS, auth; ``messages``,
  ``watch``, ``errors``);
- ``membership``: a member under an etcd lease, the leader's map upkeep, the local copy;
- ``mapwrite``: map writes conditioned on each shard's revision (nobody clobbers anybody);
- ``decide`` (pure): what a member does with each shard; ``snapshot``: its immutable verdicts
  (the server's ``Ownership`` in cluster mode);
- ``node``: ``ClusterNode``, the member inside a server: its thread, decisions published as
  snapshots, self-fencing, fences raised above the previous owners' ceilings (``fencestore``);
- ``handover``: the shard moves a member writes: handover, failover, release on a graceful leave;
- ``ops``: rebalance, pin, unpin and the ``dflockd rebalance|pin|unpin|shards`` commands.
"""

from dflockd_server.cluster.shardmap import (
    PINNED,
    SHARD_COUNT,
    Move,
    ShardAssignment,
    ShardMap,
    shard_id,
)

__all__ = ["PINNED", "SHARD_COUNT", "Move", "ShardAssignment", "ShardMap", "shard_id"]
