"""``NodeHost``: what a cluster node needs from the lock server it lives in.

The node calls these from its own thread (``key_present``: its snapshot, on the loop).
``fail_waiters`` and ``holders_in`` run their work on the server's loop and return when it is
done; the others set references and return.

What a handover relies on: on the loop, an acquire's ownership check and its grant happen with
no await between them. The node hands over a snapshot with the shard "moving out" (acquires
refused), then asks ``holders_in`` on the loop: any grant made under the older snapshot has
happened by then, so an empty answer means nobody holds a key of the shard and nobody can any
more. Likewise a snapshot that grants a shard is handed over only once the fence is raised for
it (``node``), so no token granted under it is below one granted before.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dflockd_server.cluster.snapshot import ClusterOwnership


class NodeHost(Protocol):
    """What the node needs from the lock server (see the module's docstring)."""

    def set_ownership(self, ownership: ClusterOwnership) -> None:
        """Serve by this snapshot from now on: each of the node's snapshots, handed before the
        node acts on it (the first, fenced one at the node's making)."""
        ...

    def fail_waiters(self, shard_ids: Collection[int], reply: bytes) -> object:
        """Answer every queued waiter on a key of these shards ``reply`` (a whole line)."""
        ...

    def holders_in(self, shard_ids: Collection[int]) -> set[int]:
        """Which of these shards still have a holder (lock or semaphore slot) or a queued
        waiter."""
        ...

    def key_present(self, key: str) -> bool | None:
        """On the loop (no hop): whether the table holds or queues anything on ``key``; None
        when it cannot tell (no table yet, or a restart grace: what the previous run granted
        is unknown)."""
        ...

    def renewals_allowed(self, allowed: bool) -> None:
        """Whether renewals (``n``/``sn``) may succeed."""
        ...
