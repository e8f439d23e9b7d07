"""``EtcdClient``: the etcd v3 API the lock cluster needs (ranges and counts, put,
transactions, leases, watches), every request sent through its ``EtcdTransport``. Failures
raise ``EtcdError`` naming the etcd URL and the operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dflockd_server.cluster.etcd.errors import EtcdAuthError, EtcdError
from dflockd_server.cluster.etcd.messages import (
    Compare,
    KeyValue,
    Lease,
    Op,
    Put,
    RangeResult,
    RangeStat,
    TxnResult,
    WatchEvent,
    key_range,
)
from dflockd_server.cluster.etcd.transport import EtcdTransport
from dflockd_server.cluster.etcd.watch import Watch


class EtcdClient:
    """etcd v3 through ``transport`` (or a URL, for a transport with its defaults)."""

    __slots__ = ("transport",)

    def __init__(self, transport: EtcdTransport | str) -> None:
        self.transport = EtcdTransport(transport) if isinstance(transport, str) else transport

    def __repr__(self) -> str:
        return f"EtcdClient({self.url!r})"

    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def switches(self) -> int:
        return self.transport.switches

    @property
    def preferred(self) -> int:
        return self.transport.preferred

    def range(self, key: str, *, prefix: bool = False) -> RangeResult:
        """The key (or every key under the prefix, in key order) and the current revision."""
        what = f"range of {key!r}" + (" (prefix)" if prefix else "")
        reply = self.transport.call("/v3/kv/range", key_range(key, prefix), what)
        kvs = [KeyValue.from_json(kv) for kv in reply.get("kvs", [])]
        return RangeResult(kvs, _revision(reply))

    def stat(self, key: str, *, prefix: bool = False, since: int = 0) -> RangeStat:
        """How many keys the key (or prefix) holds, and whether one was put after ``since``,
        in one read carrying at most one key and no value."""
        body = key_range(key, prefix)
        body.update({"keys_only": True, "limit": "1", "min_mod_revision": str(since + 1)})
        what = f"count of {key!r}" + (" (prefix)" if prefix else "")
        reply = self.transport.call("/v3/kv/range", body, what)
        return RangeStat(int(reply.get("count", 0)), bool(reply.get("kvs")), _revision(reply))

    def get(self, key: str) -> KeyValue | None:
        kvs = self.range(key).kvs
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self.range(prefix, prefix=True).kvs

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """If every comparison holds run ``success``, else ``failure``, atomically (at most
        ``MAX_TXN_OPS`` operations per branch)."""
        body: dict[str, Any] = {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        keys = sorted({c.key for c in compare} | {op.key for op in (*success, *failure)})
        shown = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
        reply = self.transport.call("/v3/kv/txn", body, f"transaction on {shown}")
        ranges = [
            [KeyValue.from_json(kv) for kv in r["response_range"].get("kvs", [])]
            for r in reply.get("responses", [])
            if "response_range" in r
        ]
        return TxnResult(bool(reply.get("succeeded", False)), _revision(reply), ranges)

    def create_if_absent(self, key: str, value: str, *, lease: int = 0) -> bool:
        """Put ``key`` only if it does not exist; whether it was created."""
        return self.txn([Compare(key, "CREATE", "EQUAL", 0)], [Put(key, value, lease)]).succeeded

    def compare_and_set(self, key: str, expected: str, value: str) -> bool:
        """Put ``key`` only if its value is ``expected`` (a missing key never is)."""
        return self.txn([Compare(key, "VALUE", "EQUAL", expected)], [Put(key, value)]).succeeded

    def lease_grant(self, ttl: int) -> Lease:
        """A new lease of ``ttl`` seconds (etcd may raise it to its minimum)."""
        reply = self.transport.call(
            "/v3/lease/grant", {"TTL": str(ttl)}, f"lease grant (TTL {ttl} s)"
        )
        return Lease(int(reply["ID"]), int(reply.get("TTL", 0)))

    def lease_keepalive_once(self, lease_id: int) -> int:
        """Renew the lease once; its TTL again, or 0 if it no longer exists."""
        reply = self.transport.call(
            "/v3/lease/keepalive", {"ID": str(lease_id)}, f"keep-alive of lease {lease_id:x}"
        )
        return int(reply.get("TTL", 0))

    def lease_revoke(self, lease_id: int) -> None:
        """End the lease now; its keys are deleted. A lease already gone is not an error."""
        try:
            self.transport.call(
                "/v3/lease/revoke", {"ID": str(lease_id)}, f"revoke of lease {lease_id:x}"
            )
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise

    def watch(
        self,
        key: str,
        *,
        prefix: bool = False,
        start_revision: int = 0,
        on_event: Callable[[WatchEvent], None],
    ) -> Watch:
        """Watch a key or prefix (from ``start_revision`` if given, else from now), on the
        first endpoint from the preferred one on that confirms it within ``attempt_timeout``."""
        transport = self.transport
        failures: dict[int, str] = {}
        for index, _, remaining in transport.attempts(transport.timeout):
            watch = Watch(
                transport,
                key,
                endpoint=index,
                prefix=prefix,
                start_revision=start_revision,
                on_event=on_event,
            )
            try:
                watch.start(max(min(transport.attempt_timeout, remaining), 0.05))
            except EtcdAuthError:
                raise
            except EtcdError as exc:
                failures[index] = str(exc)
            else:
                # Calls follow the watch: a member re-watches when they part.
                transport.switched(index, failures)
                return watch
        raise EtcdError(
            f"etcd at {self.url}: watch of {key!r} failed: {'; '.join(failures.values())}"
        )


def _revision(reply: dict[str, Any]) -> int:
    return int(reply.get("header", {}).get("revision", 0))
