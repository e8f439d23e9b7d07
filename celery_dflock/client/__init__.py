"""The client layer: everything that talks to lock servers, and nothing of Celery (docs/client.md).

Its public names (`Client` / `AsyncClient`, the locks and semaphores of both faces, the pools,
the sharding strategies) are exported here and from `celery_dflock`; the errors are in
`celery_dflock.client.errors`. The blocking face is generated from the asyncio one
(``scripts/unasync.py``); the I/O-free `celery_dflock.client._core.LockCore` decides."""

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
    from celery_dflock.client.sharding import ShardingStrategy, rendezvous_shard, stable_hash_shard

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
"""Public name -> its module, imported on first use (PEP 562), so importing one module of the
client does not load both faces, asyncio and ssl."""

__all__ = [
    "AsyncClient", "AsyncConnectionPool", "AsyncDistributedLock", "AsyncDistributedSemaphore",
    "Client", "ConnectionPool", "DistributedLock", "DistributedSemaphore", "Hold",
    "ShardingStrategy", "rendezvous_shard", "stable_hash_shard",
]  # fmt: skip


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_dflock.client' has no attribute {name!r}")
    value: object = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
