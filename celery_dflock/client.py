"""Blocking locks and semaphores with lease renewal in the background.

Generated from the asyncio client (`celery_dflock._sync.lock` is written by
``scripts/unasync.py`` from `celery_dflock._async.lock`), so the two faces cannot drift apart;
the decisions live in `celery_dflock._core.LockCore`::

    with DistributedLock("report:42", acquire_timeout_s=5) as lock:
        write(data, fence=lock.fence)      # renewed in the background while held

A held lock pins its connection. The renewer's `ConnectionWatcher` notices at once when that
connection closes, over plain TCP and TLS alike, and the lock then reattaches from the renewal
thread: it reconnects to the same server and renews by token there (a server restarted with its
journal, or one without auto-release, still holds it), trying again while the lease runs. A
lock that cannot be renewed (refused, or its server not reached again before the lease ran out)
is *lost*: `lost` turns True, `lost_event` is set, ``on_lost(lock)`` runs once in the renewal
thread, and a warning is logged.

Renewals run on long-lived threads: those of the `ConnectionPool`'s `Renewer` (shared by every
lock using the pool, one thread in the usual case), or, for a lock without a pool, a renewer of
its own whose thread exits when the lock is released. Nothing is started or joined per grant.
This module imports nothing of Celery.
"""

from celery_dflock._sync.lock import DistributedLock, DistributedSemaphore
from celery_dflock._sync.pool import ConnectionPool

__all__ = ["ConnectionPool", "DistributedLock", "DistributedSemaphore"]
