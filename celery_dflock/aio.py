"""asyncio locks and semaphores with lease renewal in a background task.

Same core (`celery_dflock._core.LockCore`), same behaviour and parameters as
`celery_dflock.client`; only the I/O differs::

    async with AsyncDistributedLock("report:42", acquire_timeout_s=5) as lock:
        await write(data, fence=lock.fence)

A held lock's connection is watched: when the server closes it (a restart, a drain, an idle
timeout), the renewal task wakes at once and, once no request is in flight on it, marks the
lock lost (`lost`, `lost_event`, ``on_lost``) instead of waiting for its next renewal. The
watch costs no task and no system call: the connection's protocol already hears the close.

Cancellation is safe: a request cancelled midway closes its connection (never reused out of
step). The renewal's request itself is shielded, so cancelling the renewal task (or a `renew`
call) lets the request in flight finish, and a `release` that follows waits for it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from ssl import SSLContext
from types import TracebackType
from typing import Self

from celery_dflock._connection import AsyncConnection
from celery_dflock._core import (
    ACQUIRED,
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    JOIN_TIMEOUT_S,
    QUEUED,
    EnqueueResult,
    LockCore,
    LockState,
    ServerInfo,
    redact,
)
from celery_dflock.errors import DflockError, LockNotAcquired, LockNotOwned
from celery_dflock.pool import AsyncConnectionPool
from celery_dflock.protocol import Command
from celery_dflock.sharding import ShardingStrategy, stable_hash_shard

__all__ = ["AsyncDistributedLock", "AsyncDistributedSemaphore"]

logger = logging.getLogger("celery_dflock.client")


class _AsyncLockBase:
    """What `AsyncDistributedLock` and `AsyncDistributedSemaphore` share."""

    def __init__(
        self,
        key: str,
        *,
        limit: int | None,
        acquire_timeout_s: float,
        lease_ttl_s: float | None,
        servers: Sequence[tuple[str, int]],
        sharding_strategy: ShardingStrategy,
        renew_ratio: float,
        auth_token: str | None,
        ssl_context: SSLContext | None,
        connect_timeout_s: float,
        on_lost: Callable[[Self], object] | None,
        pool: AsyncConnectionPool | None,
    ) -> None:
        self._core = LockCore(
            key,
            limit=limit,
            acquire_timeout_s=acquire_timeout_s,
            lease_ttl_s=lease_ttl_s,
            servers=servers,
            sharding_strategy=sharding_strategy,
            renew_ratio=renew_ratio,
            auth_token=auth_token,
            ssl_context=ssl_context,
            connect_timeout_s=connect_timeout_s,
        )
        if pool is not None and not isinstance(pool, AsyncConnectionPool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(
                f"pool must be a celery_dflock.AsyncConnectionPool, got {type(pool).__name__} "
                "(ConnectionPool is for the blocking locks)"
            )
        self._on_lost = on_lost
        self._pool = pool
        self._server: ServerInfo | None = None  # without a pool: asked once per lock object
        self._conn: AsyncConnection | None = None
        self._op_lock = asyncio.Lock()  # renew / release / acquire never interleave
        self._renew_task: asyncio.Task[None] | None = None
        self._renewing: asyncio.Task[bool | None] | None = None  # the shielded request
        self._wake: asyncio.Future[None] | None = None  # the renewal task's doze, cut short
        self.lost_event = asyncio.Event()
        """Set when the held lock is lost (cleared by the next successful acquire)."""

    # ------------------------------------------------------------------ attributes
    @property
    def key(self) -> str:
        """The lock key."""
        return self._core.key

    @property
    def server(self) -> tuple[str, int]:
        """The ``(host, port)`` this key is routed to."""
        return self._core.endpoint.host, self._core.endpoint.port

    @property
    def token(self) -> str | None:
        """The current grant's token (a bearer credential: do not log it), or None."""
        return self._core.token

    @property
    def lease(self) -> int:
        """Lease of the current (or last) grant in seconds, as the server granted it."""
        return self._core.lease

    @property
    def fence(self) -> int | None:
        """Fencing counter of the current grant: ``int(token[:16], 16)``; grows per grant.

        None when not held, or when the server does not issue fencing tokens (dflockd 0.4/0.5
        and the Go server: their tokens are random, so comparing them would mean nothing).
        """
        return self._core.fence

    @property
    def lost(self) -> bool:
        """True once the held lock could not be renewed (until the next acquire)."""
        return self._core.lost

    def locked(self) -> bool:
        """True while held by this object in this process (acquired, not released)."""
        return self._core.locked()

    def owned(self) -> bool:
        """`locked`, not `lost`, and the lease is known to be still running."""
        return self._core.owned()

    # ------------------------------------------------------------------ fork
    def _forked(self) -> bool:
        """In a fork child of the holder: forget the lock without touching the parent's socket
        or event loop; True."""
        if not self._core.foreign_process():
            return False
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # in a child: only drops our descriptor
        self._renew_task = self._renewing = None
        self._op_lock = asyncio.Lock()
        self._core.reset()
        return True

    # ------------------------------------------------------------------ connections
    async def _checkout(self) -> AsyncConnection:
        if self._pool is not None:
            return await self._pool.checkout(self._core.endpoint)
        conn = await AsyncConnection.connect(self._core.endpoint, self._server)
        self._server = conn.server
        return conn

    async def _checkin(self, conn: AsyncConnection) -> None:
        if self._pool is not None:
            await self._pool.checkin(conn)
        else:
            await conn.aclose()

    # ------------------------------------------------------------------ acquiring
    async def _grant(self, build: Callable[[], tuple[Command, bytes, float]]) -> bool:
        self._forked()
        async with self._op_lock:
            command, data, timeout = build()
            conn = await self._checkout()
            sent = time.monotonic()
            reply = await conn.request(command, data, timeout)
            try:
                granted = self._core.on_grant_reply(command, reply, sent, conn.server)
            except BaseException:
                await self._checkin(conn)
                raise
            if granted:
                self._conn = conn
                self._start_renewing()
            elif self._core.state is LockState.ENQUEUED:
                self._conn = conn
            else:
                await self._checkin(conn)
            return granted

    async def acquire(self) -> bool:
        """Take the lock, waiting up to ``acquire_timeout_s`` in FIFO order.

        True when granted (renewal starts), False on timeout. Cancelling it closes the
        connection, which also takes it out of the server's queue.
        """
        return await self._grant(self._core.acquire_request)

    async def enqueue(self) -> EnqueueResult:
        """Two-phase step 1: ``"acquired"`` if held at once, ``"queued"`` if queued (then
        `wait`); an `EnqueueResult`, true only when acquired."""
        return ACQUIRED if await self._grant(self._core.enqueue_request) else QUEUED

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Two-phase step 2: wait up to ``timeout_s`` (default ``acquire_timeout_s``).

        True once held (also when `enqueue` already got it); False on timeout (the queue
        position is given up).
        """
        self._forked()
        async with self._op_lock:
            if self._core.state is LockState.HELD:
                return True
            command, data, timeout = self._core.wait_request(timeout_s)
            conn, self._conn = self._conn, None
            if conn is None:  # pragma: no cover - ENQUEUED always has a connection
                self._core.reset()
                raise LockNotOwned(f"{self._core.what} lost its queue connection")
            sent = time.monotonic()
            try:
                reply = await conn.request(command, data, timeout)
                granted = self._core.on_grant_reply(command, reply, sent, conn.server)
            except BaseException:
                self._core.reset()
                conn.close()
                raise
            if granted:
                self._conn = conn
                self._start_renewing()
                return True
            await conn.aclose()
            return False

    # ------------------------------------------------------------------ renewing
    def _start_renewing(self) -> None:
        self.lost_event.clear()
        conn = self._conn
        if conn is not None:
            conn.watch(self._connection_event)
        self._renew_task = asyncio.create_task(
            self._renew_loop(self._core.first_renewal_in()), name=f"dflock-renew:{self._core.key}"
        )

    def _unwatch(self, conn: AsyncConnection | None) -> None:
        if conn is not None:
            conn.watch(None)

    def _connection_event(self) -> None:
        """The held connection heard from the peer (bytes, EOF, or lost): wake the renewal
        task, which checks the connection under the operation lock (so never while a request
        is in flight). Runs in the event loop; during a renewal's request nothing dozes."""
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _doze(self, until: float) -> None:
        """Sleep until the loop time ``until``, or less if the held connection breaks."""
        conn = self._conn
        if conn is not None and conn.broken_while_idle():
            return  # it broke during the last request or before this task ran
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wake = wake
        try:
            async with asyncio.timeout_at(until):
                await wake
        except TimeoutError:
            pass
        finally:
            self._wake = None

    async def _renew_loop(self, first_in: float) -> None:
        loop = asyncio.get_running_loop()
        interval = self._core.renew_interval()
        due = loop.time() + first_in
        while True:
            await self._doze(due)
            conn = self._conn
            if loop.time() < due and conn is not None and not conn.broken_while_idle():
                continue  # woken, but the connection is fine: renew when due
            if not await self._renew_shielded():
                return
            due = loop.time() + interval

    async def _renew_shielded(self) -> bool | None:
        """Run one renewal in its own task, shielded: cancelling the caller does not
        interrupt the request (a later `release` waits for it instead)."""
        task = asyncio.create_task(self._renew_guarded())
        self._renewing = task
        return await asyncio.shield(task)

    async def _renew_guarded(self) -> bool | None:
        try:
            return await self._renew_once()
        except Exception as exc:  # never let the task die with an unretrieved exception
            logger.exception("unexpected error renewing dflock %s", self._core.what)
            first = self._core.mark_lost(f"unexpected error while renewing: {exc!r}")
            if first:
                await self._notify_lost()
            return False

    async def _renew_once(self) -> bool | None:
        """One renewal: True renewed, False lost now or before, None nothing to renew."""
        async with self._op_lock:
            conn = self._conn
            if self._core.state is not LockState.HELD:
                return None
            if self._core.lost or conn is None:
                return False
            if conn.broken_while_idle():
                # Closed by the server (which released the lock with it): lost, no request.
                self._conn = None
                self._unwatch(conn)
                conn.close()
                first = self._core.mark_connection_closed()
            else:
                first = await self._renew_request(conn)
                if first is None:
                    if conn.broken_while_idle():
                        # Closed right after its reply: the renewal task, if it dozes
                        # (this was `renew`), was woken while the request was in flight.
                        self._connection_event()
                    return True
        if first:
            await self._notify_lost()
        return False

    async def _renew_request(self, conn: AsyncConnection) -> bool | None:
        """Send one renewal on ``conn`` (operation lock held): None renewed, else lost
        (True the first time)."""
        command, data, timeout = self._core.renew_request()
        sent = time.monotonic()
        try:
            reply = await conn.request(command, data, timeout)
        except DflockError as exc:
            self._conn = None  # the request closed it: the server frees its locks
            self._unwatch(conn)
            reason = str(exc)
        else:
            outcome = self._core.on_renew_reply(reply, sent)
            if outcome.renewed:
                return None
            reason = outcome.lost_reason or "renewal refused"
        return self._core.mark_lost(reason)

    async def _notify_lost(self) -> None:
        self.lost_event.set()
        callback = self._on_lost
        if callback is None:
            return
        try:
            result = callback(self)
            if inspect.isawaitable(result):
                awaitable: Awaitable[object] = result
                await awaitable
        except Exception:
            logger.exception("the on_lost callback of dflock %s raised", self._core.what)

    async def renew(self) -> bool:
        """Renew the lease now (the background task does this on its own).

        True if renewed; False if the lock is lost. Raises `LockNotOwned` when not held.
        Cancelling this call does not interrupt the request in flight.
        """
        if self._forked():
            raise LockNotOwned(
                f"{self._core.what} was acquired by the parent process before a fork; "
                "a child process cannot renew it (acquire a lock of its own)"
            )
        result = await self._renew_shielded()
        if result is None:
            raise LockNotOwned(f"{self._core.what} is not held by this object: acquire() it first")
        return result

    # ------------------------------------------------------------------ releasing
    async def release(self) -> bool:
        """Release the lock; True if the server confirmed it. Idempotent.

        Stops the renewal task first (waiting for a renewal in flight). False when nothing
        was held, the lock was lost, or its connection broke. If the server no longer held
        the grant (its lease ran out unnoticed), the lock was lost before this release: it is
        reported as lost (`lost`, `lost_event`, ``on_lost``) first. Cancelling it midway
        closes the connection, which makes the server release the lock.
        """
        if self._forked():
            return False
        try:
            task, self._renew_task = self._renew_task, None
            current = asyncio.current_task()
            if task is not None and task is not current:
                task.cancel()
                await asyncio.wait([task])
            renewing = self._renewing
            if renewing is not None and renewing is not current and not renewing.done():
                # The shielded renewal goes on after its loop is cancelled; it, and the
                # on_lost it may be running, end before the grant is forgotten here: that
                # callback still reads the lost grant's fence (bounded, as in the sync
                # release: an on_lost that waits for this release must not hang both).
                await asyncio.wait([renewing], timeout=JOIN_TIMEOUT_S)
            async with self._op_lock:
                released = await self._release_locked()
                lost_here = self._core.lost and self._core.state is LockState.HELD
            if lost_here:
                # The server no longer held the grant: lost before this release, never silent.
                # Notified outside the operation lock (the callback may use the lock), with
                # the fence still known; then forgotten.
                await self._notify_lost()
                async with self._op_lock:
                    if self._core.lost and self._core.state is LockState.HELD:
                        self._core.reset()
            return released
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Interrupted release: close the pinned connection (the server then frees the lock
        and any queue position) rather than leave a held lock without renewal."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.watch(None)
            conn.close()
        self._core.reset()

    async def _release_locked(self) -> bool:
        conn, self._conn = self._conn, None
        self._unwatch(conn)
        state = self._core.state
        if state is LockState.IDLE:
            return False
        if state is LockState.ENQUEUED or conn is None or conn.closed:
            self._core.reset()
            if conn is not None:
                await conn.aclose()  # no dequeue command: closing leaves the queue
            return False
        if self._core.lost:
            self._core.reset()
            await self._checkin(conn)
            return False
        command, data, timeout = self._core.release_request()
        try:
            reply = await conn.request(command, data, timeout)
        except DflockError as exc:
            self._core.reset()
            logger.info(
                "releasing dflock %s failed (%s); the server frees it with the connection",
                self._core.what,
                redact(str(exc)),
            )
            return False
        except BaseException:
            self._core.reset()  # cancelled: the request closed the connection
            raise
        released = self._core.on_release_reply(reply)  # refused: marked lost, still HELD
        await self._checkin(conn)
        return released

    # ------------------------------------------------------------------ context manager
    async def __aenter__(self) -> Self:
        if not await self.acquire():
            raise LockNotAcquired(
                f"could not acquire {self._core.what} on {self._core.endpoint.address} "
                f"within {self._core.acquire_timeout_s}s"
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.describe()})"


class AsyncDistributedLock(_AsyncLockBase):
    """The asyncio twin of `celery_dflock.DistributedLock` (same parameters; ``pool`` is an
    `AsyncConnectionPool`; ``on_lost`` may be a coroutine function)."""

    def __init__(  # noqa: PLR0917 - positional order is the dflockd client's
        self,
        key: str,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: float | None = None,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        sharding_strategy: ShardingStrategy = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        *,
        auth_token: str | None = None,
        ssl_context: SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        on_lost: Callable[[Self], object] | None = None,
        pool: AsyncConnectionPool | None = None,
    ) -> None:
        super().__init__(
            key,
            limit=None,
            acquire_timeout_s=acquire_timeout_s,
            lease_ttl_s=lease_ttl_s,
            servers=servers,
            sharding_strategy=sharding_strategy,
            renew_ratio=renew_ratio,
            auth_token=auth_token,
            ssl_context=ssl_context,
            connect_timeout_s=connect_timeout_s,
            on_lost=on_lost,
            pool=pool,
        )


class AsyncDistributedSemaphore(_AsyncLockBase):
    """The asyncio twin of `celery_dflock.DistributedSemaphore`."""

    def __init__(  # noqa: PLR0917 - positional order is the dflockd client's
        self,
        key: str,
        limit: int,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: float | None = None,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        sharding_strategy: ShardingStrategy = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        *,
        auth_token: str | None = None,
        ssl_context: SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        on_lost: Callable[[Self], object] | None = None,
        pool: AsyncConnectionPool | None = None,
    ) -> None:
        super().__init__(
            key,
            limit=limit,
            acquire_timeout_s=acquire_timeout_s,
            lease_ttl_s=lease_ttl_s,
            servers=servers,
            sharding_strategy=sharding_strategy,
            renew_ratio=renew_ratio,
            auth_token=auth_token,
            ssl_context=ssl_context,
            connect_timeout_s=connect_timeout_s,
            on_lost=on_lost,
            pool=pool,
        )

    @property
    def limit(self) -> int:
        """The semaphore's number of slots."""
        assert self._core.limit is not None
        return self._core.limit
