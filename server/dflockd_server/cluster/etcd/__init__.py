"""A small etcd v3 client over etcd's JSON gateway (HTTP/1.1, standard library only).

- ``client``: ``EtcdClient``, the API the cluster uses: keys, transactions, leases, watches;
- ``transport``: how a request reaches etcd: endpoints and fail-over, when a request is sent
  again, TLS, authentication;
- ``messages`` (pure): the JSON gateway's messages (base64 keys, comparisons, operations);
- ``watch``: a running watch of a key or prefix (a thread reading etcd's event stream);
- ``errors``: ``EtcdError`` and its kinds.

Import the names from here (``from dflockd_server.cluster.etcd import EtcdClient``).
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
from dflockd_server.cluster.etcd.transport import (
    Endpoint,
    EtcdTransport,
    parse_etcd_url,
    tls_context,
)
from dflockd_server.cluster.etcd.watch import Watch

__all__ = [
    "MAX_TXN_OPS",
    "Compare",
    "Delete",
    "DuplicateMember",
    "Endpoint",
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
    "parse_etcd_url",
    "prefix_end",
    "tls_context",
]
