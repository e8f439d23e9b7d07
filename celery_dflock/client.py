"""Blocking locks and semaphores with lease renewal in the background.

Generated from the asyncio client (`celery_dflock._sync.lock` is written by
``scripts/unasync.py`` from `celery_dflock._async.lock`), so the two faces cannot drift apart;
the decisions live in `celery_dflock._core.LockCore`::

    with DistributedLock("report:42", acquire_timeout_s=5) as lock:
        write(data, fence=lock.fence)      # renewed in the background while held

A held lock pins its connection (the server frees a connection's locks when it closes). A lock
that cannot be renewed (refused, or its server gone) is *lost*: `lost` turns True,
`lost_event` is set, ``on_lost(lock)`` runs once in the renewal thread, and a warning is logged.
The renewer's `ConnectionWatcher` also notices at once when the server closes a held lock's
connection, over plain TCP and TLS alike (then ``on_lost`` runs in the watcher's thread).

Renewals run on long-lived threads: those of the `ConnectionPool`'s `Renewer` (shared by every
lock using the pool, one thread in the usual case), or, for a lock without a pool, a renewer of
its own whose thread exits when the lock is released. Nothing is started or joined per grant.
This module imports nothing of Celery.
"""

from celery_dflock._sync.lock import DistributedLock, DistributedSemaphore
from celery_dflock._sync.pool import ConnectionPool

__all__ = ["ConnectionPool", "DistributedLock", "DistributedSemaphore"]
