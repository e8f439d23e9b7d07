"""``dflockd pin`` and ``dflockd unpin`` as the tests call them: the commands' own step."""

from __future__ import annotations

from dflockd_server.cluster.etcd import EtcdClient
from dflockd_server.cluster.ops import change_shard
from dflockd_server.cluster.shardmap import ShardAssignment


def pin(client: EtcdClient, prefix: str, shard: int, node: str | None = None) -> ShardAssignment:
    return change_shard(client, prefix, shard, "pin", node)


def unpin(client: EtcdClient, prefix: str, shard: int) -> ShardAssignment:
    return change_shard(client, prefix, shard, "unpin")
