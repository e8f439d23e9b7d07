"""The operator's commands (``dflockd shards|rebalance|pin|unpin``) run as an operator runs
them, the real ``dflockd`` executable against a real etcd, on bad input and from the server's
environment."""

from __future__ import annotations

from dflockd_server.cluster.etcd import EtcdClient
from dflockd_server.cluster.mapwrite import ShardWrite, write_shards
from dflockd_server.cluster.membership import ClusterKeys
from dflockd_server.cluster.shardmap import ShardMap
from tests.support.etcd import EtcdServer, put
from tests.support.servers import run_dflockd


def test_the_commands_read_the_cluster_from_dflockd_cluster(
    etcd_server: EtcdServer, etcd: EtcdClient, etcd_prefix: str
) -> None:
    """In the server's environment (a container started with ``DFLOCKD_CLUSTER``), ``dflockd
    shards`` finds the cluster there as the server does, and as their error for a bad URL
    (``--cluster (or DFLOCKD_CLUSTER)``) says: it stopped at "the following arguments are
    required: --cluster" (exit 2). A ``--cluster`` typed on the command line wins, as the
    commands' other flags win over their variables."""
    prefix = etcd_prefix.rstrip("/")
    url = f"etcd://127.0.0.1:{etcd_server.client_port}{prefix}"
    keys = ClusterKeys(prefix)
    m = ShardMap.initial(["a:1"])
    write_shards(etcd, keys.shards, {s: ShardWrite(0, a) for s, a in m.items()})
    put(etcd, keys.member("a:1"), "a:1")
    shown = run_dflockd(["shards"], {"DFLOCKD_CLUSTER": url})
    assert shown.returncode == 0, shown
    assert "live members: a:1" in shown.stdout, shown
    shown = run_dflockd(["shards", "--cluster", url], {"DFLOCKD_CLUSTER": "etcd://127.0.0.1:1"})
    assert shown.returncode == 0 and "live members: a:1" in shown.stdout, shown
    shown = run_dflockd(["shards"], {"DFLOCKD_CLUSTER": "http://x:1"})
    assert shown.returncode == 2 and "DFLOCKD_CLUSTER" in shown.stderr, shown
    shown = run_dflockd(["shards"], {})
    assert shown.returncode == 2, shown
    assert "--cluster" in shown.stderr and "DFLOCKD_CLUSTER" in shown.stderr, shown
