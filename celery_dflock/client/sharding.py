"""Which of several lock servers a key goes to ([Several servers](../client.md#several-servers)).

A strategy maps ``(key, number_of_servers)`` to an index into ``servers``; the key's lock lives
on that server only. `stable_hash_shard` (the default) is every dflockd client's
``zlib.crc32(key.encode("utf-8")) % n``, so they agree on where a key lives. `rendezvous_shard`
(highest-random-weight) hashes ``blake2b(key, server identity)``: as a lock's
``sharding_strategy`` the identity is the server's ``"host:port"``, so the order of ``servers``
does not matter; called as ``rendezvous_shard(key, n)`` it hashes on ``"0"``..``"n-1"``: then
append new servers at the end.

Moving keys while locks are held splits a key's holders across two servers: change the server
list only when no lock is held (servers started with the same list, ``--members``, refuse a
client whose list disagrees: `ShardingMismatchError`).

`CLUSTER` (``sharding_strategy="cluster"``): the servers are seeds of a cluster, which says
where each key lives (`ClusterMap`); the client caches that map and follows its redirects."""

from __future__ import annotations

import hashlib
import ipaddress
import zlib
from collections.abc import Callable, Sequence
from typing import Final, Literal, Protocol, TypeGuard, cast, runtime_checkable

from celery_dflock.client.errors import InvalidValueError

__all__ = [
    "CLUSTER", "IdentityShardingStrategy", "RendezvousShard", "Routing", "ShardingStrategy",
    "rendezvous_shard", "select_server", "server_identity", "stable_hash_shard", "validate_servers",
]  # fmt: skip

ShardingStrategy = Callable[[str, int], int]
"""Maps ``(key, number_of_servers)`` to an index in ``range(number_of_servers)``."""

CLUSTER: Final = "cluster"
"""``sharding_strategy="cluster"``: the servers are a cluster's seeds; it says where keys live."""

Routing = ShardingStrategy | Literal["cluster"]
"""What ``sharding_strategy`` accepts: a strategy over the server list, or `CLUSTER`."""


@runtime_checkable
class IdentityShardingStrategy(Protocol):
    """A strategy that can also route on the servers' identities (``"host:port"``)."""

    def __call__(self, key: str, num_servers: int) -> int: ...

    def shard_by_identity(self, key: str, identities: Sequence[str]) -> int: ...


def stable_hash_shard(key: str, num_servers: int) -> int:
    """``zlib.crc32(key.encode("utf-8")) % num_servers``, as every dflockd client computes it."""
    _check_count(num_servers)
    return zlib.crc32(key.encode("utf-8")) % num_servers


class RendezvousShard:
    """Rendezvous hashing; stateless: use the `rendezvous_shard` instance."""

    __slots__ = ()

    def __call__(self, key: str, num_servers: int) -> int:
        _check_count(num_servers)
        return self.shard_by_identity(key, [str(i) for i in range(num_servers)])

    def shard_by_identity(self, key: str, identities: Sequence[str]) -> int:
        """Index of the identity with the highest weight for ``key`` (ties: the first one)."""
        _check_count(len(identities))
        prefix = key.encode("utf-8") + b"\x00"
        weights = [
            int.from_bytes(hashlib.blake2b(prefix + i.encode("utf-8"), digest_size=8).digest())
            for i in identities
        ]
        return weights.index(max(weights))

    def __repr__(self) -> str:
        return "rendezvous_shard"


rendezvous_shard = RendezvousShard()
"""Rendezvous hashing; routes on ``"host:port"`` when used as a lock's ``sharding_strategy``."""


def server_identity(server: tuple[str, int]) -> str:
    return f"{server[0]}:{server[1]}"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(num_servers: int) -> None:
    if not _is_int(num_servers) or num_servers < 1:
        raise InvalidValueError(f"the number of servers must be an int >= 1, got {num_servers!r}")


def _strategy_name(strategy: object) -> str:
    name = getattr(strategy, "__qualname__", None)
    if isinstance(name, str):
        module = getattr(strategy, "__module__", None)
        return f"{module}.{name}" if isinstance(module, str) else name
    return repr(strategy)


def validate_servers(servers: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """Check a ``servers`` list and return it as a tuple; `ValueError` says what is wrong."""
    given = cast("object", servers)
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise InvalidValueError(f"servers must be a list of (host, port) tuples, got {given!r}")
    entries: Sequence[object] = given  # pyright: ignore[reportUnknownVariableType]
    if not entries:
        raise InvalidValueError(
            'servers is empty: give at least one (host, port), e.g. [("127.0.0.1", 6388)]'
        )
    result: list[tuple[str, int]] = []
    for entry in entries:
        if not isinstance(entry, tuple | list) or len(entry) != 2:  # pyright: ignore[reportUnknownArgumentType]
            raise InvalidValueError(f"each server must be a (host, port) tuple, got {entry!r}")
        host, port = cast("Sequence[object]", entry)
        if not isinstance(host, str) or not host:
            raise InvalidValueError(
                f"server host must be a non-empty string, got {host!r} in {entry!r}"
            )
        if any(ch.isspace() or ch in ",/" for ch in host):  # a URL's scheme or path, a list
            raise InvalidValueError(
                f"server host {host!r} is not a host name or address (in {entry!r}): give "
                "the bare host, no scheme, path or spaces (e.g. ('127.0.0.1', 6388), in "
                "Celery '127.0.0.1:6388')"
            )
        if (":" in host or "[" in host) and not _is_ipv6(host):  # "host:port" as the host
            raise InvalidValueError(
                f"server host {host!r} is not a host name or address (in {entry!r}): give the "
                "port apart and an IPv6 address without brackets (e.g. ('127.0.0.1', 6388), "
                "('::1', 6388))"
            )
        if not _is_int(port) or not 0 < port <= 65535:
            raise InvalidValueError(
                f"server port must be an int in 1..65535, got {port!r} in {entry!r}"
            )
        result.append((host, port))
    return tuple(result)


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _routes_by_identity(strategy: object) -> TypeGuard[IdentityShardingStrategy]:
    """``isinstance(strategy, IdentityShardingStrategy)``, without typing's slow check."""
    return callable(strategy) and getattr(strategy, "shard_by_identity", None) is not None


def select_server(
    key: str,
    servers: Sequence[tuple[str, int]] | Sequence[str],
    strategy: ShardingStrategy = stable_hash_shard,
) -> int:
    """Index into ``servers`` (``(host, port)`` tuples or identity strings) of the server that
    owns ``key`` under ``strategy``; an `IdentityShardingStrategy` routes on the identities."""
    count = len(servers)
    _check_count(count)
    if count == 1 and (strategy is stable_hash_shard or strategy is rendezvous_shard):
        return 0  # what both compute for one server
    if _routes_by_identity(strategy):
        identities = [s if isinstance(s, str) else server_identity(s) for s in servers]
        raw: object = strategy.shard_by_identity(key, identities)
    else:
        raw = strategy(key, count)
    if not _is_int(raw):
        raise InvalidValueError(
            f"sharding strategy {_strategy_name(strategy)} returned {raw!r} "
            f"for key {key!r}: it must return an int index into servers"
        )
    if not 0 <= raw < count:
        raise InvalidValueError(
            f"sharding strategy {_strategy_name(strategy)} returned {raw} for key {key!r}, "
            f"outside [0, {count}) for {count} server(s)"
        )
    return raw
