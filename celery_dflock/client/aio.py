"""asyncio locks and semaphores with lease renewal in a background task.

The same lock shell as the blocking one, with the same parameters and behaviour: it is written
once, as these asyncio classes (`celery_dflock.client._async.lock`), and the blocking ones are
generated from it::

    async with AsyncDistributedLock("report:42", acquire_timeout_s=5) as lock:
        await write(data, fence=lock.fence)

A held lock's connection is watched: when it closes (a restart, a drain, a network cut, an idle
timeout), the renewal task wakes at once and, once no request is in flight on it, reattaches
the lock: it reconnects to the same server and renews by token there, trying again while the
lease runs, instead of waiting for its next renewal. Only when that renewal is refused, or the
lease runs out first, is the lock lost (`lost`, `lost_event`, ``on_lost``; a coroutine
function's result is awaited). The watch costs no task and no system call: the connection's
protocol already hears the close.

Cancellation is safe: a request cancelled midway closes its connection (never reused out of
step). The renewal's request itself is shielded, so cancelling the renewal task (or a `renew`
call) lets the request in flight finish, and a `release` that follows waits for it.
"""

from celery_dflock.client._async.lock import AsyncDistributedLock, AsyncDistributedSemaphore
from celery_dflock.client._async.pool import AsyncConnectionPool

__all__ = ["AsyncConnectionPool", "AsyncDistributedLock", "AsyncDistributedSemaphore"]
