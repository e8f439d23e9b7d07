"""asyncio locks and semaphores, renewed by a background task, with the blocking ones' arguments and
behaviour (docs/client.md). ``on_lost``'s result is awaited when it is a coroutine. Cancellation is
safe: a request cancelled midway closes its connection; the renewal's request is shielded."""

from celery_dflock.client._async.lock import AsyncDistributedLock, AsyncDistributedSemaphore
from celery_dflock.client._async.pool import AsyncConnectionPool

__all__ = ["AsyncConnectionPool", "AsyncDistributedLock", "AsyncDistributedSemaphore"]
