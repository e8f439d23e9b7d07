"""What must outlive a member, in etcd, one key per member and no lease: its fence ceiling
(``<prefix>/fence/<advertise>``) and the longest lease it may have granted
(``<prefix>/longest/<advertise>``). A member stores its ceiling before issuing any counter at
or above it; whoever takes one of its shards over raises its own counter above it first.
"""

from __future__ import annotations

from dflockd_server.cluster.etcd import Compare, EtcdClient, EtcdError, Put
from dflockd_server.fence import FenceStateError

FENCE = "/fence/"
LONGEST = "/longest/"


def _counter(value: str) -> int | None:
    text = value.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _parse(key: str, value: str) -> int:
    counter = _counter(value)
    if counter is None:
        raise FenceStateError(
            f"fence ceiling {key!r} in etcd does not hold a decimal counter "
            f"(found {value[:40]!r}); fix or delete it"
        )
    return counter


class EtcdCeilingStore:
    """A `dflockd_server.fence.CeilingStore` at ``<prefix>/fence/<advertise>``."""

    __slots__ = ("client", "key")

    def __init__(self, client: EtcdClient, prefix: str, advertise: str) -> None:
        self.client = client
        self.key = prefix + FENCE + advertise

    def read(self) -> int:
        try:
            kv = self.client.get(self.key)
        except EtcdError as exc:
            raise FenceStateError(f"cannot read the fence ceiling: {exc}") from exc
        return 0 if kv is None else _parse(self.key, kv.value)

    def write(self, ceiling: int) -> None:
        # Never lower it: a stale writer must not undo a higher ceiling already stored.
        try:
            kv = self.client.get(self.key)
            if kv is not None and _parse(self.key, kv.value) >= ceiling:
                return
            written = (
                self.client.create_if_absent(self.key, str(ceiling))
                if kv is None
                else self.client.compare_and_set(self.key, kv.value, str(ceiling))
            )
            if not written:
                # A resent write the first attempt made fails its comparison.
                kv = self.client.get(self.key)
                written = kv is not None and _parse(self.key, kv.value) >= ceiling
        except EtcdError as exc:
            raise FenceStateError(f"cannot store the fence ceiling: {exc}") from exc
        if not written:
            raise FenceStateError(
                f"fence ceiling {self.key!r} changed while being stored: is another server "
                "using the same --advertise address?"
            )


class EtcdLongestStore:
    """Publishes the longest lease a member may have granted (``grace.LeaseRecord``'s
    ``publish``): an heir of its shards waits that long after its death."""

    __slots__ = ("client", "key")

    def __init__(self, client: EtcdClient, prefix: str, advertise: str) -> None:
        self.client = client
        self.key = prefix + LONGEST + advertise

    def write(self, longest: int) -> None:
        # On condition that the key is as read: a write etcd applies late cannot put back an
        # older bound over a newer one.
        value = str(longest)
        try:
            for _ in range(3):
                kv = self.client.get(self.key)
                if kv is not None and kv.value == value:
                    return
                unchanged = Compare.unchanged(self.key, 0 if kv is None else kv.mod_revision)
                if self.client.txn([unchanged], [Put(self.key, value)]).succeeded:
                    return
        except EtcdError as exc:
            raise FenceStateError(f"cannot publish the longest lease in etcd: {exc}") from exc
        raise FenceStateError(
            f"the longest lease {self.key!r} in etcd keeps changing while being published: is "
            "another server using the same --advertise address?"
        )


def _published(client: EtcdClient, under: str, what: str) -> dict[str, str]:
    """Member -> the value it published under ``under``."""
    try:
        kvs = client.get_prefix(under)
    except EtcdError as exc:
        raise FenceStateError(f"cannot read {what}: {exc}") from exc
    return {kv.key[len(under) :]: kv.value for kv in kvs}


def published_longest(client: EtcdClient, prefix: str) -> dict[str, int]:
    """Member -> the longest lease it published (members that published none are absent)."""
    found = _published(client, prefix + LONGEST, "the published longest leases")
    return {m: longest for m, v in found.items() if (longest := _counter(v)) is not None}


def highest_ceiling(client: EtcdClient, prefix: str, excluding: str = "") -> int:
    """The highest ceiling any member (but ``excluding``) stored, 0 when none."""
    found = _published(client, prefix + FENCE, "the fence ceilings")
    return max(
        (_parse(prefix + FENCE + m, v) for m, v in found.items() if m != excluding), default=0
    )
