"""Where a key lives in a cluster of lock servers, from what the servers say to ``shards``
(no I/O). `ShardsInfo` reads any mode's answer; `ClusterMap` is a cluster-mode answer made
ready for routing: a key's shard is ``fnv1a_32(key) % shard_count``, and its server the
shard's *current* node, or its *target* while it has none.

`fnv1a_32` is the server's hash, written again here so that the client needs nothing of the
server's package; a test holds the two equal."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final, TypeVar

from celery_dflock.client import wire
from celery_dflock.client.errors import ProtocolError

__all__ = ["ClusterMap", "ShardsInfo", "fnv1a_32"]

_FNV32_OFFSET: Final = 0x811C9DC5
_FNV32_PRIME: Final = 0x01000193
_U32: Final = 0xFFFFFFFF
T = TypeVar("T")


def fnv1a_32(data: bytes) -> int:
    """FNV-1a, 32 bits (Go's ``hash/fnv`` ``New32a``), as the cluster's servers hash keys."""
    h = _FNV32_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV32_PRIME) & _U32
    return h


def _listed(data: dict[str, object], name: str, where: str, kind: type[T]) -> tuple[T, ...]:
    value = data.get(name, [])
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: '{name}' is not a list in the shards reply")
    items: list[object] = list(value)  # pyright: ignore[reportUnknownArgumentType]
    kept = tuple(item for item in items if isinstance(item, kind) and not isinstance(item, bool))
    if len(kept) != len(items):
        what = "HOST:PORT strings" if kind is str else "integers"
        raise ProtocolError(f"{where}: '{name}' is not a list of {what}")
    return kept


def _optional_str(data: dict[str, object], name: str) -> str | None:
    value = data.get(name)
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class ShardsInfo:
    """What one server answered to ``shards``, in any mode (``single``, ``static``,
    ``cluster``); ``members`` are the static list or the live cluster members."""

    mode: str
    self_address: str | None = None
    members: tuple[str, ...] = ()
    strategy: str | None = None
    leader: str | None = None
    cluster: ClusterMap | None = None

    @classmethod
    def parse(cls, data: dict[str, object], where: str = "the server") -> ShardsInfo:
        mode = data.get("mode")
        if not isinstance(mode, str):
            raise ProtocolError(f"{where} answered shards without a 'mode'")
        cluster = ClusterMap.parse(data, where) if mode == wire.MODE_CLUSTER else None
        return cls(
            mode=mode,
            self_address=_optional_str(data, "self"),
            members=_listed(data, "members", where, str),
            strategy=_optional_str(data, "strategy"),
            leader=_optional_str(data, "leader"),
            cluster=cluster,
        )

    def shards_per_member(self) -> dict[str, int]:
        """Shards each node is the current node of (cluster mode; else empty)."""
        if self.cluster is None:
            return {}
        counts = Counter(self.cluster.current)
        return {node: counts.get(index, 0) for index, node in enumerate(self.cluster.nodes)}

    @property
    def moving(self) -> tuple[int, ...]:
        """Shards whose target is not their current node (cluster mode; else none)."""
        return () if self.cluster is None else self.cluster.moving


@dataclass(frozen=True, slots=True)
class ClusterMap:
    """A cluster's fixed shard map as one member described it."""

    shard_count: int
    nodes: tuple[str, ...]
    current: tuple[int, ...]
    target: tuple[int, ...]
    members: tuple[str, ...] = ()
    leader: str | None = None
    pinned: tuple[int, ...] = ()
    moving: tuple[int, ...] = ()
    split: tuple[int, ...] = ()
    """Per shard moving key by key, the node its keys may be granted at (-1: none; empty
    from a server that predates it)."""
    source: str | None = field(default=None, compare=False)  # the member that answered

    @classmethod
    def parse(cls, data: dict[str, object], where: str = "the server") -> ClusterMap:
        if data.get("mode") != wire.MODE_CLUSTER:
            raise ProtocolError(f"{where} is not in cluster mode (shards said {data!r:.200})")
        if data.get("hash") != wire.HASH_FNV1A32:
            raise ProtocolError(
                f"{where} hashes keys with {data.get('hash')!r}; this client knows only "
                f"{wire.HASH_FNV1A32!r} (upgrade celery-dflock)"
            )
        count = data.get("shard_count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ProtocolError(f"{where}: shard_count {count!r} is not a positive integer")
        nodes = _listed(data, "nodes", where, str)
        current = _listed(data, "current", where, int)
        target = _listed(data, "target", where, int)
        split = _listed(data, "split", where, int)
        if len(current) != count or len(target) != count or len(split) not in (0, count):
            raise ProtocolError(f"{where}: current and target must list {count} shards each")
        if any(not -1 <= index < len(nodes) for index in (*current, *target, *split)):
            raise ProtocolError(f"{where}: a shard names a node outside 'nodes'")
        return cls(
            shard_count=count,
            nodes=nodes,
            current=current,
            target=target,
            members=_listed(data, "members", where, str),
            leader=_optional_str(data, "leader"),
            pinned=_listed(data, "pinned", where, int),
            moving=_listed(data, "moving", where, int),
            split=split,
            source=_optional_str(data, "self"),
        )

    def shard_of(self, key: str) -> int:
        return fnv1a_32(key.encode("utf-8")) % self.shard_count

    def owner(self, key: str) -> str | None:
        """``HOST:PORT`` of the node that serves ``key`` now (None: not known)."""
        shard = self.shard_of(key)
        index = self.current[shard]
        if index < 0:
            index = self.target[shard]
        return None if index < 0 else self.nodes[index]
