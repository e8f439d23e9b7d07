"""celery-dflock: distributed locks for Celery, backed by a dflockd-compatible lock server.

The client: `Client` / `AsyncClient` (servers, auth, TLS and a connection pool held once;
locks, semaphores, release by token, stats, ping), `DistributedLock` / `DistributedSemaphore`
(blocking, renewed by a thread), `AsyncDistributedLock` / `AsyncDistributedSemaphore`
(asyncio, renewed by a task), connection pools, sharding strategies and the `DflockError`
hierarchy. The Celery integration: `LockedTask` and `SingletonScheduler`.

Every name is imported on first use (PEP 562): ``import celery_dflock`` loads the client layer
(`celery_dflock.client`, which imports nothing of Celery) and Celery only when a Celery-side
name is first used.
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
    )
    from celery_dflock.client import (
        AsyncConnectionPool as AsyncConnectionPool,
    )
    from celery_dflock.client import (
        AsyncDistributedLock as AsyncDistributedLock,
    )
    from celery_dflock.client import (
        AsyncDistributedSemaphore as AsyncDistributedSemaphore,
    )
    from celery_dflock.client import (
        Client as Client,
    )
    from celery_dflock.client import (
        ConnectionPool as ConnectionPool,
    )
    from celery_dflock.client import (
        DistributedLock as DistributedLock,
    )
    from celery_dflock.client import (
        DistributedSemaphore as DistributedSemaphore,
    )
    from celery_dflock.client import (
        Hold as Hold,
    )
    from celery_dflock.client import (
        ShardingStrategy as ShardingStrategy,
    )
    from celery_dflock.client import (
        rendezvous_shard as rendezvous_shard,
    )
    from celery_dflock.client import (
        stable_hash_shard as stable_hash_shard,
    )
    from celery_dflock.client.errors import (
        AlreadyQueued as AlreadyQueued,
    )
    from celery_dflock.client.errors import (
        AuthError as AuthError,
    )
    from celery_dflock.client.errors import (
        DflockError as DflockError,
    )
    from celery_dflock.client.errors import (
        HoldsUnsupported as HoldsUnsupported,
    )
    from celery_dflock.client.errors import (
        InvalidValueError as InvalidValueError,
    )
    from celery_dflock.client.errors import (
        KeyHeld as KeyHeld,
    )
    from celery_dflock.client.errors import (
        LimitMismatchError as LimitMismatchError,
    )
    from celery_dflock.client.errors import (
        LockLost as LockLost,
    )
    from celery_dflock.client.errors import (
        LockNotAcquired as LockNotAcquired,
    )
    from celery_dflock.client.errors import (
        LockNotOwned as LockNotOwned,
    )
    from celery_dflock.client.errors import (
        LockSkipped as LockSkipped,
    )
    from celery_dflock.client.errors import (
        MaxLocksError as MaxLocksError,
    )
    from celery_dflock.client.errors import (
        MaxWaitersError as MaxWaitersError,
    )
    from celery_dflock.client.errors import (
        ProtocolError as ProtocolError,
    )
    from celery_dflock.client.errors import (
        ServerDraining as ServerDraining,
    )
    from celery_dflock.client.errors import (
        ServerUnavailable as ServerUnavailable,
    )
    from celery_dflock.client.errors import (
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
"""Public name -> the module that defines it (imported when the name is first used)."""

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
