"""A small etcd v3 client over etcd's JSON gateway (HTTP/1.1, standard library only):
``client`` (``EtcdClient``), ``transport`` (endpoints, fail-over, TLS, auth), ``messages``,
``watch`` and ``errors``. Import the names from here.
"""

from dflockd_server.cluster.etcd.client import EtcdClient
from dflockd_server.cluster.etcd.errors import DuplicateMember, EtcdAuthError, EtcdError
from dflockd_server.cluster.etcd.messages import (
    MAX_TXN_OPS,
    Compare,
    Delete,
    Get,
    KeyValue,
    Lease,
    Op,
    Put,
    RangeResult,
    RangeStat,
    TxnResult,
    WatchEvent,
    prefix_end,
)
from dflockd_server.cluster.etcd.transport import EtcdTransport, tls_context
from dflockd_server.cluster.etcd.watch import Watch

__all__ = [
    "MAX_TXN_OPS",
    "Compare",
    "Delete",
    "DuplicateMember",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdTransport",
    "Get",
    "KeyValue",
    "Lease",
    "Op",
    "Put",
    "RangeResult",
    "RangeStat",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "prefix_end",
    "tls_context",
]
