"""Which keys this server serves: the ``Ownership`` a ``Server`` asks before an acquire.

Three modes (docs/protocol.md, *Ownership*):

* ``SingleOwnership``: every key (the dispatch skips the check altogether).
* ``StaticOwnership`` (``--members ... --advertise ...``): the keys the clients' crc32 strategy
  over that list gives to this member (``celery_dflock.client.sharding.stable_hash_shard``);
  any other key is answered ``error_moved <its owner>``, so a client whose list disagrees
  learns it at its first acquire.
* cluster mode: the cluster node hands the server a new ``cluster.snapshot.ClusterOwnership``
  whenever its view of the shard map or its lease changes.

An ownership object is an immutable snapshot, swapped whole (``Server.set_ownership``)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Final, Protocol

from dflockd_server import constants as c, protocol as p

__all__ = ["Ownership", "SingleOwnership", "StaticOwnership"]


class Ownership(Protocol):
    """What a server asks about the keys it is asked to grant."""

    def check(self, key: str) -> bytes | None:
        """None: serve it. Else the whole reply line to send instead (bytes ending in \\n)."""
        ...

    def check_asked(self, key: str) -> bytes | None:
        """``check`` for an acquire that follows ``asking``."""
        ...

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        """An ``asking`` for ``key`` with ``ticket``: None to let the next acquire of ``key``
        be checked by ``check_asked``; else the reply to the ``asking``."""
        ...

    def may_hold(self, key: str) -> bool:
        """Whether a grant on ``key`` may be renewed, taken over or handed down here now."""
        ...

    def describe(self) -> dict[str, object]:
        """The JSON object ``shards`` answers."""
        ...


class SingleOwnership:
    """Serves every key (the default)."""

    __slots__ = ()

    def check(self, key: str) -> bytes | None:
        return None

    def check_asked(self, key: str) -> bytes | None:
        return None

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        return None

    def may_hold(self, key: str) -> bool:
        return True

    def describe(self) -> dict[str, object]:
        return {"mode": c.MODE_SINGLE}


SINGLE: Final = SingleOwnership()


class StaticOwnership:
    """Serves the keys the crc32 strategy over ``members`` gives to ``advertise``."""

    __slots__ = ("_count", "_index", "_moved", "advertise", "members")

    def __init__(self, members: Sequence[str], advertise: str) -> None:
        members = tuple(members)  # checked where they enter: Config (--members, --advertise)
        self.members = members
        self.advertise = advertise
        self._count = len(members)
        self._index = members.index(advertise)
        self._moved = tuple(p.reply_moved(member) for member in members)

    def check(self, key: str) -> bytes | None:
        index = zlib.crc32(key.encode()) % self._count
        return None if index == self._index else self._moved[index]

    def check_asked(self, key: str) -> bytes | None:
        return self.check(key)

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        return None

    def may_hold(self, key: str) -> bool:
        return True

    def describe(self) -> dict[str, object]:
        return {
            "mode": c.MODE_STATIC,
            "self": self.advertise,
            "members": list(self.members),
            "strategy": c.STRATEGY_CRC32,
        }
