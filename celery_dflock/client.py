"""Blocking locks and semaphores with lease renewal in a background thread.

The decisions live in `celery_dflock._core.LockCore` (shared with `celery_dflock.aio`); this
module does the socket I/O and schedules renewals (`celery_dflock._renewal`)::

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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from ssl import SSLContext
from types import TracebackType
from typing import Self

from celery_dflock._connection import Connection
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
from celery_dflock._renewal import Renewal, Renewer
from celery_dflock.errors import DflockError, LockNotAcquired, LockNotOwned
from celery_dflock.pool import ConnectionPool
from celery_dflock.protocol import Command
from celery_dflock.sharding import ShardingStrategy, stable_hash_shard

__all__ = ["DistributedLock", "DistributedSemaphore"]

logger = logging.getLogger("celery_dflock.client")


class _SyncLockBase:
    """What `DistributedLock` and `DistributedSemaphore` share (all of it but the commands)."""

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
        pool: ConnectionPool | None,
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
        if pool is not None and not isinstance(pool, ConnectionPool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(
                f"pool must be a celery_dflock.ConnectionPool, got {type(pool).__name__} "
                "(AsyncConnectionPool is for the async locks)"
            )
        self._on_lost = on_lost
        self._pool = pool
        self._server: ServerInfo | None = None  # without a pool: asked once per lock object
        self._conn: Connection | None = None
        self._op_lock = threading.RLock()  # renew / release / acquire never interleave
        self._renewal: Renewal | None = None  # the current grant's place in the renewal schedule
        self._watched_fd: int | None = None  # the held connection's socket, watched for EOF
        self._own_renewer: Renewer | None = None  # without a pool: this lock's own
        self._lost_event: threading.Event | None = None  # made on first use (see lost_event)
        self._lost_event_guard = threading.Lock()

    # ------------------------------------------------------------------ attributes
    @property
    def lost_event(self) -> threading.Event:
        """Set when the held lock is lost (cleared by the next successful acquire)."""
        event = self._lost_event
        if event is None:
            # Made when first asked for or set: most locks are never lost or waited on.
            with self._lost_event_guard:
                event = self._lost_event
                if event is None:
                    event = self._lost_event = threading.Event()
        return event

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
        """In a fork child of the process that holds the lock: forget it, True.

        Only our copy of the socket is closed (never shut down), so the parent keeps its
        connection and its lock; the parent's renewal thread does not exist here.
        """
        if not self._core.foreign_process():
            return False
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        self._op_lock = threading.RLock()
        self._renewal = None  # the parent's schedule, not this process's
        self._watched_fd = None  # watched by the parent's watcher, not this process's
        logger.debug("%s was acquired by the parent process; the child ignores it", self._core.what)
        self._core.reset()
        return True

    # ------------------------------------------------------------------ connections
    def _checkout(self) -> Connection:
        if self._pool is not None:
            return self._pool.checkout(self._core.endpoint)
        conn = Connection.connect(self._core.endpoint, self._server)
        self._server = conn.server
        return conn

    def _checkin(self, conn: Connection) -> None:
        if self._pool is not None:
            self._pool.checkin(conn)
        else:
            conn.close()

    # ------------------------------------------------------------------ acquiring
    def _grant(self, build: Callable[[], tuple[Command, bytes, float]]) -> bool:
        self._forked()
        with self._op_lock:
            command, data, timeout = build()
            conn = self._checkout()
            sent = time.monotonic()
            reply = conn.request(command, data, timeout)
            try:
                granted = self._core.on_grant_reply(command, reply, sent, conn.server)
            except BaseException:
                self._checkin(conn)
                raise
            if granted:
                self._conn = conn
                self._start_renewing()
            elif self._core.state is LockState.ENQUEUED:
                self._conn = conn
            else:
                self._checkin(conn)
            return granted

    def acquire(self) -> bool:
        """Take the lock, waiting up to ``acquire_timeout_s`` in FIFO order.

        True when granted (renewal starts), False on timeout. Raises `ServerUnavailable`,
        `AuthError`, `MaxLocksError`, ... when the server cannot or will not answer.
        """
        return self._grant(self._core.acquire_request)

    def enqueue(self) -> EnqueueResult:
        """Two-phase step 1: join the queue without blocking.

        ``"acquired"`` if the lock was free and is now held, ``"queued"`` if queued (then call
        `wait`); an `EnqueueResult`, true only when acquired (``if lock.enqueue():`` works).
        """
        return ACQUIRED if self._grant(self._core.enqueue_request) else QUEUED

    def wait(self, timeout_s: float | None = None) -> bool:
        """Two-phase step 2: wait up to ``timeout_s`` (default ``acquire_timeout_s``).

        True once held (also when `enqueue` already got it). False on timeout; the queue
        position is then given up (its connection is closed).
        """
        self._forked()
        with self._op_lock:
            if self._core.state is LockState.HELD:
                return True
            command, data, timeout = self._core.wait_request(timeout_s)
            conn, self._conn = self._conn, None
            if conn is None:  # pragma: no cover - ENQUEUED always has a connection
                self._core.reset()
                raise LockNotOwned(f"{self._core.what} lost its queue connection")
            sent = time.monotonic()
            try:
                reply = conn.request(command, data, timeout)
                granted = self._core.on_grant_reply(command, reply, sent, conn.server)
            except BaseException:
                self._core.reset()
                conn.close()
                raise
            if granted:
                self._conn = conn
                self._start_renewing()
                return True
            conn.close()  # leave the queue for sure
            return False

    # ------------------------------------------------------------------ renewing
    def _renewer(self) -> Renewer:
        if self._pool is not None:
            return self._pool.renewer
        renewer = self._own_renewer
        if renewer is None:
            # Serves this object only: its thread exits as soon as nothing is held.
            renewer = Renewer(linger_s=0, name=f"dflock-renew:{self._core.key}")
            self._own_renewer = renewer
        return renewer

    def _start_renewing(self) -> None:
        event = self._lost_event
        if event is not None:
            event.clear()
        core = self._core
        self._renewal = self._renewer().schedule(
            self._renew_due, core.renew_interval(), core.first_renewal_in()
        )
        self._watch()

    # ------------------------------------------------------------------ a closed connection
    def _watch(self) -> None:
        """Watch the held connection for a close by the server (operation lock held)."""
        conn = self._conn
        fd = conn.watchable_fd() if conn is not None else None
        if conn is None or fd is None:
            return
        self._watched_fd = fd
        self._renewer().watcher.watch(fd, lambda: self._connection_event(conn))

    def _unwatch(self) -> None:
        fd, self._watched_fd = self._watched_fd, None
        if fd is not None:
            self._renewer().watcher.unwatch(fd)

    def _connection_event(self, conn: Connection) -> bool:
        """The held connection became readable with no request of ours in flight: the server
        closed it (and released the lock with it). Marks the lock lost at once; never
        interrupts a request (an operation under way sees the broken connection itself, and a
        renewal watches again once it is done). True to keep watching."""
        if not self._op_lock.acquire(blocking=False):
            return False
        first = False
        try:
            if self._conn is not conn or self._core.state is not LockState.HELD or self._core.lost:
                return False
            if not conn.broken_while_idle():
                return True  # a reply was read meanwhile: nothing wrong
            self._conn = None
            self._watched_fd = None
            conn.close()
            first = self._core.mark_connection_closed()
        finally:
            self._op_lock.release()
        if first:
            renewal = self._renewal
            if renewal is not None:
                renewal.cancel()
            self._notify_lost()
        return False

    def _renew_due(self, renewal: Renewal) -> bool:
        """Called by the renewer every interval; True to be called again."""
        try:
            return self._renew_once(renewal) is True
        except Exception as exc:  # never let a renewal end with a traceback
            logger.exception("unexpected error renewing dflock %s", self._core.what)
            with self._op_lock:
                first = self._core.mark_lost(f"unexpected error while renewing: {exc!r}")
            if first:
                self._notify_lost()
            return False

    def _renew_once(self, renewal: Renewal | None) -> bool | None:
        """One renewal: True renewed, False lost now or before, None nothing to renew."""
        with self._op_lock:
            conn = self._conn
            cancelled = renewal is not None and renewal.cancelled
            if cancelled or self._core.state is not LockState.HELD:
                return None
            if self._core.lost or conn is None:
                return False
            command, data, timeout = self._core.renew_request()
            sent = time.monotonic()
            try:
                reply = conn.request(command, data, timeout)
            except DflockError as exc:
                self._conn = None  # the request closed it: the server frees its locks
                self._unwatch()
                reason = str(exc)
            else:
                outcome = self._core.on_renew_reply(reply, sent)
                if outcome.renewed:
                    self._watch()  # the watcher may have let go while the request ran
                    return True
                reason = outcome.lost_reason or "renewal refused"
            first = self._core.mark_lost(reason)
        if first:
            self._notify_lost()
        return False

    def _notify_lost(self) -> None:
        self.lost_event.set()
        callback = self._on_lost
        if callback is None:
            return
        try:
            callback(self)
        except Exception:
            logger.exception("the on_lost callback of dflock %s raised", self._core.what)

    def renew(self) -> bool:
        """Renew the lease now (the background thread does this on its own).

        True if renewed; False if the lock is lost (then `lost` is True, ``on_lost`` ran).
        Raises `LockNotOwned` when not held (also in a fork child of the holder).
        """
        if self._forked():
            raise LockNotOwned(
                f"{self._core.what} was acquired by the parent process before a fork; "
                "a child process cannot renew it (acquire a lock of its own)"
            )
        result = self._renew_once(None)
        if result is None:
            raise LockNotOwned(f"{self._core.what} is not held by this object: acquire() it first")
        return result

    # ------------------------------------------------------------------ releasing
    def release(self) -> bool:
        """Release the lock; True if the server confirmed it. Idempotent.

        False when nothing was held, the lock was lost, or its connection broke (the server
        frees a closed connection's locks itself). If the server no longer held the grant
        (its lease ran out unnoticed, e.g. while the process was paused), the lock was lost
        before this release: it is reported as lost (`lost`, `lost_event`, ``on_lost``) first.
        Leaves a queue after `enqueue`. In a fork child of the holder, does nothing (the
        parent's lock and socket are untouched).
        """
        if self._forked():
            return False
        renewal = self._renewal
        if renewal is not None:
            renewal.cancel()  # no renewal starts after this
            # One under way, and the on_lost it may be running, ends before the grant is
            # forgotten here: that callback still reads the lost grant's fence (not when
            # release runs inside that on_lost).
            renewal.wait(JOIN_TIMEOUT_S)
            if self._renewal is renewal:
                self._renewal = None
        with self._op_lock:
            released = self._release_locked()
            lost_here = self._core.lost and self._core.state is LockState.HELD
        if lost_here:
            # The server no longer held the grant: lost before this release, never silent.
            # Notified outside the operation lock (the callback may use the lock), with the
            # fence still known; then forgotten.
            self._notify_lost()
            with self._op_lock:
                if self._core.lost and self._core.state is LockState.HELD:
                    self._core.reset()
        return released

    def _release_locked(self) -> bool:
        self._unwatch()
        conn, self._conn = self._conn, None
        state = self._core.state
        if state is LockState.IDLE:
            return False
        if state is LockState.ENQUEUED or conn is None or conn.closed:
            self._core.reset()
            if conn is not None:
                conn.close()  # no dequeue command: closing the connection leaves the queue
            return False
        if self._core.lost:
            self._core.reset()
            self._checkin(conn)
            return False
        command, data, timeout = self._core.release_request()
        try:
            reply = conn.request(command, data, timeout)
        except DflockError as exc:
            self._core.reset()
            logger.info(
                "releasing dflock %s failed (%s); the server frees it with the connection",
                self._core.what,
                redact(str(exc)),
            )
            return False
        except BaseException:
            self._core.reset()  # interrupted: the request closed the connection
            raise
        released = self._core.on_release_reply(reply)  # refused: marked lost, still HELD
        self._checkin(conn)
        return released

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Self:
        if not self.acquire():
            raise LockNotAcquired(
                f"could not acquire {self._core.what} on {self._core.endpoint.address} "
                f"within {self._core.acquire_timeout_s}s"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.describe()})"


class DistributedLock(_SyncLockBase):
    """A distributed mutex on ``key``, held on the server the key is routed to.

    Parameters as the dflockd client: ``acquire_timeout_s`` (FIFO wait; 0 tries once),
    ``lease_ttl_s`` (None: the server's default), ``servers`` and ``sharding_strategy``
    (which server owns the key), ``renew_ratio`` (renew every ``lease * renew_ratio``
    seconds). Also: ``auth_token`` (sent first on every connection), ``ssl_context`` (TLS),
    ``connect_timeout_s``, ``on_lost`` (called once, from the renewal or watcher thread, with the
    lock when it is lost) and ``pool`` (a `ConnectionPool`; without one the lock opens its own
    connection and closes it on release). Seconds are whole on the wire: fractions round up.
    """

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
        pool: ConnectionPool | None = None,
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


class DistributedSemaphore(_SyncLockBase):
    """Up to ``limit`` concurrent holders of ``key`` (every user of the key passes the same
    limit). Otherwise exactly like `DistributedLock`; each holder has its own token."""

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
        pool: ConnectionPool | None = None,
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
