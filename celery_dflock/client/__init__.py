"""The client layer: everything that talks to lock servers, and nothing of Celery.

Its public names (`Client` / `AsyncClient`, the locks and semaphores of both faces, the pools,
the sharding strategies) are exported here and from `celery_dflock`; the errors are in
`celery_dflock.client.errors`. Blocking locks and semaphores renew their lease in the background.

The blocking face is generated from the asyncio one (`celery_dflock.client._sync.lock` is
written by ``scripts/unasync.py`` from `celery_dflock.client._async.lock`), so the two faces cannot
drift apart; the decisions live in `celery_dflock.client._core.LockCore`::

    with DistributedLock("report:42", acquire_timeout_s=5) as lock:
        write(data, fence=lock.fence)      # renewed in the background while held

A held lock pins its connection. The renewer's `ConnectionWatcher` notices at once when that
connection closes, over plain TCP and TLS alike, and the lock then reattaches from the renewal
thread: it reconnects to the same server and renews by token there (a server restarted with its
journal, one without auto-release, or one that keeps a session connection's grants for its
session time after a reset, still holds it), trying again while the lease runs (on a session
connection: until the session's deadline, counted from the send time of its last answered
request, unless the server was found down). A
lock that cannot be renewed (refused, or its server not reached again before the lease ran out)
is *lost*: `lost` turns True, `lost_event` is set, ``on_lost(lock)`` runs once in the renewal
thread, and a warning is logged.

Renewals run on long-lived threads: those of the `ConnectionPool`'s `Renewer` (shared by every
lock using the pool, one thread in the usual case), or, for a lock without a pool, a renewer of
its own whose thread exits when the lock is released. Nothing is started or joined per grant.
This module imports nothing of Celery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from celery_dflock.client._async.client import AsyncClient
    from celery_dflock.client._async.lock import AsyncDistributedLock, AsyncDistributedSemaphore
    from celery_dflock.client._async.pool import AsyncConnectionPool
    from celery_dflock.client._servers import Hold
    from celery_dflock.client._sync.client import Client
    from celery_dflock.client._sync.lock import DistributedLock, DistributedSemaphore
    from celery_dflock.client._sync.pool import ConnectionPool
    from celery_dflock.client.sharding import (
        ShardingStrategy,
        rendezvous_shard,
        stable_hash_shard,
    )

_WHERE: Final[dict[str, str]] = {
    "AsyncClient": "celery_dflock.client._async.client",
    "Client": "celery_dflock.client._sync.client",
    "Hold": "celery_dflock.client._servers",
    "AsyncDistributedLock": "celery_dflock.client._async.lock",
    "AsyncDistributedSemaphore": "celery_dflock.client._async.lock",
    "AsyncConnectionPool": "celery_dflock.client._async.pool",
    "DistributedLock": "celery_dflock.client._sync.lock",
    "DistributedSemaphore": "celery_dflock.client._sync.lock",
    "ConnectionPool": "celery_dflock.client._sync.pool",
    "ShardingStrategy": "celery_dflock.client.sharding",
    "rendezvous_shard": "celery_dflock.client.sharding",
    "stable_hash_shard": "celery_dflock.client.sharding",
}
"""Public name -> the module that defines it, imported on first use (PEP 562): importing one
module of the client (its errors, its codec) does not load both faces, asyncio and ssl."""

__all__ = [
    "AsyncClient",
    "AsyncConnectionPool",
    "AsyncDistributedLock",
    "AsyncDistributedSemaphore",
    "Client",
    "ConnectionPool",
    "DistributedLock",
    "DistributedSemaphore",
    "Hold",
    "ShardingStrategy",
    "rendezvous_shard",
    "stable_hash_shard",
]


def __getattr__(name: str) -> object:
    """Import a public name on first use (and keep it, so this runs once per name)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_dflock.client' has no attribute {name!r}")
    value: object = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
