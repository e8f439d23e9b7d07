"""``NodeHost``: what a cluster node needs from the lock server it lives in.

The server implements these three calls (thread-safe: each runs its work on the server's loop
and returns when it is done); the node calls them from its own thread.

What a handover relies on: on the loop, an acquire's ownership check and its grant happen with
no await between them. The node publishes "moving out" (acquires refused), then asks
``holders_in`` on the loop: any grant made under the older snapshot has happened by then, so
an empty answer means nobody holds a key of the shard and nobody can any more.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol


class NodeHost(Protocol):
    """What the node needs from the lock server; each call is thread-safe and runs the work on
    the server's loop, returning when it is done."""

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
