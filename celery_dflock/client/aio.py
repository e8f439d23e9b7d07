"""asyncio locks and semaphores with lease renewal in a background task.

The same lock as the blocking one, with the same parameters and behaviour::

    async with AsyncDistributedLock("report:42", acquire_timeout_s=5) as lock:
        await write(data, fence=lock.fence)

``on_lost``'s result is awaited when it is a coroutine. Cancellation is safe: a request
cancelled midway closes its connection; the renewal's request is shielded."""

from celery_dflock.client._async.lock import AsyncDistributedLock, AsyncDistributedSemaphore
from celery_dflock.client._async.pool import AsyncConnectionPool

__all__ = ["AsyncConnectionPool", "AsyncDistributedLock", "AsyncDistributedSemaphore"]
