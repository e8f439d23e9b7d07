"""celery-dflock: distributed locks for Celery, backed by a dflockd-compatible lock server.

The client: `DistributedLock` / `DistributedSemaphore` (blocking, renewed by a thread),
`AsyncDistributedLock` / `AsyncDistributedSemaphore` (asyncio, renewed by a task), connection
pools, sharding strategies and the `DflockError` hierarchy.
"""

from celery_dflock.aio import AsyncDistributedLock, AsyncDistributedSemaphore
from celery_dflock.beat import SingletonScheduler
from celery_dflock.client import DistributedLock, DistributedSemaphore
from celery_dflock.errors import (
    AuthError,
    DflockError,
    LimitMismatchError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    LockSkipped,
    MaxLocksError,
    MaxWaitersError,
    ProtocolError,
    ServerDraining,
    ServerUnavailable,
)
from celery_dflock.pool import AsyncConnectionPool, ConnectionPool
from celery_dflock.sharding import ShardingStrategy, rendezvous_shard, stable_hash_shard
from celery_dflock.task import LockedTask

__version__ = "0.2.0"
"""This release (the ``dflockd-server`` it depends on has the same version)."""

__all__ = [
    "AsyncConnectionPool",
    "AsyncDistributedLock",
    "AsyncDistributedSemaphore",
    "AuthError",
    "ConnectionPool",
    "DflockError",
    "DistributedLock",
    "DistributedSemaphore",
    "LimitMismatchError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "LockSkipped",
    "LockedTask",
    "MaxLocksError",
    "MaxWaitersError",
    "ProtocolError",
    "ServerDraining",
    "ServerUnavailable",
    "ShardingStrategy",
    "SingletonScheduler",
    "__version__",
    "rendezvous_shard",
    "stable_hash_shard",
]
