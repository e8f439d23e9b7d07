"""``NodeHost``: what a cluster node needs from the lock server it lives in.

``fail_waiters`` and ``holders_in`` run on the server's loop and return when done; the others
set references and return.

What a handover relies on: on the loop, an acquire's ownership check and its grant happen with
no await between them. So once a snapshot with the shard "moving out" is handed over, an empty
``holders_in`` answer means nobody holds a key of the shard and nobody can any more.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dflockd_server.cluster.snapshot import ClusterOwnership


class NodeHost(Protocol):
    def set_ownership(self, ownership: ClusterOwnership) -> None:
        """Serve by this snapshot from now on."""
        ...

    def fail_waiters(self, shard_ids: Collection[int], reply: bytes) -> object:
        """Answer every queued waiter on a key of these shards ``reply`` (a whole line)."""
        ...

    def holders_in(self, shard_ids: Collection[int]) -> set[int]:
        """Which of these shards still have a holder or a queued waiter."""
        ...

    def key_present(self, key: str) -> bool | None:
        """On the loop: whether the table holds or queues anything on ``key``; None when it
        cannot tell (no table yet, or a restart grace)."""
        ...

    def renewals_allowed(self, allowed: bool) -> None:
        """Whether renewals (``n``/``sn``) may succeed."""
        ...
