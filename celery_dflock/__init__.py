"""celery-dflock: distributed locks for Celery, backed by a dflockd-compatible lock server.

The client: `Client` / `AsyncClient` (servers, auth, TLS and a connection pool held once;
locks, semaphores, release by token, stats, ping), `DistributedLock` / `DistributedSemaphore`
(blocking, renewed by a thread), `AsyncDistributedLock` / `AsyncDistributedSemaphore`
(asyncio, renewed by a task), connection pools, sharding strategies and the `DflockError`
hierarchy. The Celery integration: `LockedTask` and `SingletonScheduler`.

Every name is imported on first use (PEP 562), so ``import celery_dflock.client`` does not
import Celery, and ``import celery_dflock`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

from celery_dflock import errors as _errors  # no Celery, nothing but the exceptions

if TYPE_CHECKING:
    from celery_dflock.aio import AsyncDistributedLock, AsyncDistributedSemaphore
    from celery_dflock.beat import SingletonScheduler
    from celery_dflock.client import DistributedLock, DistributedSemaphore
    from celery_dflock.clients import AsyncClient, Client, Hold
    from celery_dflock.errors import (
        AlreadyQueued,
        AuthError,
        DflockError,
        HoldsUnsupported,
        InvalidValueError,
        KeyHeld,
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
        ShardingMismatchError,
    )
    from celery_dflock.pool import AsyncConnectionPool, ConnectionPool
    from celery_dflock.sharding import ShardingStrategy, rendezvous_shard, stable_hash_shard
    from celery_dflock.task import LockedTask

__version__ = "0.2.0"
"""This release (the ``dflockd-server`` it depends on has the same version)."""

_WHERE: Final[dict[str, str]] = {
    "AsyncClient": "celery_dflock.clients",
    "Client": "celery_dflock.clients",
    "Hold": "celery_dflock.clients",
    "AsyncDistributedLock": "celery_dflock.aio",
    "AsyncDistributedSemaphore": "celery_dflock.aio",
    "DistributedLock": "celery_dflock.client",
    "DistributedSemaphore": "celery_dflock.client",
    "AsyncConnectionPool": "celery_dflock.pool",
    "ConnectionPool": "celery_dflock.pool",
    "ShardingStrategy": "celery_dflock.sharding",
    "rendezvous_shard": "celery_dflock.sharding",
    "stable_hash_shard": "celery_dflock.sharding",
    "LockedTask": "celery_dflock.task",
    "SingletonScheduler": "celery_dflock.beat",
    **dict.fromkeys(_errors.__all__, "celery_dflock.errors"),
}
"""Public name -> the module that defines it (imported when the name is first used)."""

__all__ = [
    "AlreadyQueued",
    "AsyncClient",
    "AsyncConnectionPool",
    "AsyncDistributedLock",
    "AsyncDistributedSemaphore",
    "AuthError",
    "Client",
    "ConnectionPool",
    "DflockError",
    "DistributedLock",
    "DistributedSemaphore",
    "Hold",
    "HoldsUnsupported",
    "InvalidValueError",
    "KeyHeld",
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
    "ShardingMismatchError",
    "ShardingStrategy",
    "SingletonScheduler",
    "__version__",
    "rendezvous_shard",
    "stable_hash_shard",
]


def __getattr__(name: str) -> object:
    """Import a public name on first use (and keep it, so this runs once per name)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_dflock' has no attribute {name!r}")
    value: object = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
