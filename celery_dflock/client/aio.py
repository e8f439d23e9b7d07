"""asyncio locks and semaphores with lease renewal in a background task.

The same lock as the blocking one, with the same parameters and behaviour: it is written once,
as these asyncio classes (`celery_dflock.client._async.lock`), and the blocking ones are
generated from it::

    async with AsyncDistributedLock("report:42", acquire_timeout_s=5) as lock:
        await write(data, fence=lock.fence)

A held lock's connection is watched at no cost (its protocol hears the close): when it closes,
the renewal task reattaches the lock at once. ``on_lost``'s result is awaited when it is a
coroutine. Cancellation is safe: a request cancelled midway closes its connection (never
reused out of step); the renewal's request is shielded, so cancelling the renewal task (or a
`renew` call) lets it finish, and a `release` that follows waits for it.
"""

from celery_dflock.client._async.lock import AsyncDistributedLock, AsyncDistributedSemaphore
from celery_dflock.client._async.pool import AsyncConnectionPool

__all__ = ["AsyncConnectionPool", "AsyncDistributedLock", "AsyncDistributedSemaphore"]
