"""celery-dflock: distributed locks for Celery, backed by a dflockd-compatible lock server.

The client: `Client` / `AsyncClient` (servers, auth, TLS and a connection pool held once;
locks, semaphores, release by token, stats, ping), `DistributedLock` / `DistributedSemaphore`
(blocking, renewed by a thread), `AsyncDistributedLock` / `AsyncDistributedSemaphore`
(asyncio, renewed by a task), connection pools, sharding strategies and the `DflockError`
hierarchy. The Celery integration: `LockedTask` and `SingletonScheduler`.

Every name is imported on first use (PEP 562): Celery is loaded only when a Celery-side name
is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

import celery_dflock.client as _client
import celery_dflock.client.errors as _errors

# Spelled out (not ``import *``): the type checker and the docs' reference read these
# statically; tests/test_architecture.py checks they are exactly the lazily served names.
if TYPE_CHECKING:
    from celery_dflock.beat import SingletonScheduler as SingletonScheduler
    from celery_dflock.client import (
        AsyncClient as AsyncClient,
        AsyncConnectionPool as AsyncConnectionPool,
        AsyncDistributedLock as AsyncDistributedLock,
        AsyncDistributedSemaphore as AsyncDistributedSemaphore,
        Client as Client,
        ConnectionPool as ConnectionPool,
        DistributedLock as DistributedLock,
        DistributedSemaphore as DistributedSemaphore,
        Hold as Hold,
        ShardingStrategy as ShardingStrategy,
        rendezvous_shard as rendezvous_shard,
        stable_hash_shard as stable_hash_shard,
    )
    from celery_dflock.client.errors import (
        AlreadyQueued as AlreadyQueued,
        AuthError as AuthError,
        DflockError as DflockError,
        ForceReleaseUnsupported as ForceReleaseUnsupported,
        HoldsUnsupported as HoldsUnsupported,
        InvalidValueError as InvalidValueError,
        KeyHeld as KeyHeld,
        LimitMismatchError as LimitMismatchError,
        LockLost as LockLost,
        LockNotAcquired as LockNotAcquired,
        LockNotOwned as LockNotOwned,
        LockSkipped as LockSkipped,
        MaxLocksError as MaxLocksError,
        MaxWaitersError as MaxWaitersError,
        ProtocolError as ProtocolError,
        ServerDraining as ServerDraining,
        ServerReadOnly as ServerReadOnly,
        ServerUnavailable as ServerUnavailable,
        ShardingMismatchError as ShardingMismatchError,
    )
    from celery_dflock.task import LockedTask

__version__ = "0.2.0"
"""This release (the ``dflockd-server`` it depends on has the same version)."""

_WHERE: Final[dict[str, str]] = {
    **dict.fromkeys(_client.__all__, "celery_dflock.client"),
    **dict.fromkeys(_errors.__all__, "celery_dflock.client.errors"),
    "LockedTask": "celery_dflock.task",
    "SingletonScheduler": "celery_dflock.beat",
}
"""Public name -> the module that defines it."""

__all__ = ["LockedTask", "SingletonScheduler", "__version__"]
__all__ += _client.__all__
__all__ += _errors.__all__


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
