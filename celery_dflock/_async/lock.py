"""Locks and semaphores with lease renewal in the background: the shell around `LockCore`.

This file is the one place the lock shell is written. It is the asyncio face; the blocking face
(`celery_dflock._sync.lock`) is generated from it by ``scripts/unasync.py``. The decisions live
in the I/O-free `celery_dflock._core.LockCore`; what each face does its own way (renewal task or
renewal thread, how a closed connection is noticed, how ``on_lost`` is called) lives in
`celery_dflock._aio_backend` / `celery_dflock._sync_backend`.

A held lock pins its connection (the server frees a connection's locks when it closes, unless
it restarts with its journal, or auto-release is off, or a hold outlives it). When that
connection closes or breaks (a restart, a drain, a network cut, an idle timeout; noticed at
once, never while a request is in flight on it), the lock *reattaches*: it reconnects to the
same server and renews by token there, pausing briefly between attempts, for as long as the
lease it last confirmed still runs; the new connection is pinned. A lock that cannot be renewed
is *lost*: the renewal was refused (``error``: the server no longer holds it), or the lease ran
out before the server could be reached. Then `lost` turns True, `lost_event` is set,
``on_lost(lock)`` runs once, and a warning is logged. `release` on a broken connection likewise
reconnects and releases by token.

An interrupted request (a timeout, an exception, a cancellation) closes its connection, which is
never reused out of step; an interrupted release closes the pinned connection, so the server
frees the lock rather than keep it without renewal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from ssl import SSLContext
from types import TracebackType
from typing import Self

from celery_dflock import protocol
from celery_dflock._aio_backend import AsyncRenewalDriver, Event, OpLock, call_back, pause
from celery_dflock._async.pool import AsyncConnectionPool
from celery_dflock._connection import AsyncConnection
from celery_dflock._core import (
    ACQUIRED,
    CLOSED_BY_SERVER,
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    QUEUED,
    ClusterRouter,
    Endpoint,
    EnqueueResult,
    Hold,
    LockCore,
    LockState,
    RenewOutcome,
    ServerInfo,
    redact,
    whole_seconds,
)
from celery_dflock.cluster import ClusterMap
from celery_dflock.errors import (
    AuthError,
    DflockError,
    KeyHeld,
    LockNotAcquired,
    LockNotOwned,
    ServerDraining,
    ServerUnavailable,
)
from celery_dflock.protocol import Command, Renewed, Reply
from celery_dflock.sharding import Routing, stable_hash_shard

__all__ = ["AsyncDistributedLock", "AsyncDistributedSemaphore"]

logger = logging.getLogger("celery_dflock.client")

_Build = Callable[[ServerInfo | None], tuple[Command, bytes, float]]
"""Makes an acquire's request for the server at hand (what it said to ``hello``)."""


class _AsyncLockBase:
    """What `AsyncDistributedLock` and `AsyncDistributedSemaphore` share (all but the commands)."""

    def __init__(
        self,
        core: LockCore,
        on_lost: Callable[[Self], object] | None,
        pool: AsyncConnectionPool | None,
    ) -> None:
        self._core = core
        if pool is not None and not isinstance(pool, AsyncConnectionPool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(
                f"pool must be a celery_dflock.{AsyncConnectionPool.__name__}, got "
                f"{type(pool).__name__} (the blocking and the asyncio locks each take a pool "
                "of their own kind)"
            )
        self._on_lost = on_lost
        self._pool = pool
        self._server: ServerInfo | None = None  # without a pool: asked once per lock object
        self._server_at: Endpoint | None = None  # the endpoint `_server` describes
        self._conn: AsyncConnection | None = None
        self._op_lock = OpLock()  # renew / release / acquire never interleave
        self._driver = AsyncRenewalDriver(self, pool)
        self._lost_event: Event | None = None  # made on first use (see lost_event)
        self._lost_event_guard = threading.Lock()

    # ------------------------------------------------------------------ attributes
    @property
    def lost_event(self) -> Event:
        """Set when the held lock is lost (cleared by the next successful acquire)."""
        event = self._lost_event
        if event is None:
            # Made when first asked for or set: most locks are never lost or waited on.
            with self._lost_event_guard:
                event = self._lost_event
                if event is None:
                    event = self._lost_event = Event()
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
    def holder(self) -> str | None:
        """After an acquire that failed because the key was busy: the note its holder gave
        (servers with holds; None when it gave none, or the acquire did not fail so)."""
        return self._core.holder

    @property
    def handover(self) -> str | None:
        """After an acquire that was not granted because a hand-over of its key's shard
        between cluster members outlasted its time: why, naming the key and the member (None
        when it did not fail so)."""
        return self._core.handover

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
        """True once the held lock could not be renewed (until the next acquire).

        Reads True once the loss is reported: with `lost_event` set, just before ``on_lost``
        runs (so whoever sees ``lost`` finds ``lost_event`` set, and an ``on_lost`` that
        interrupts a body does so before that body can have polled ``lost`` for long)."""
        event = self._lost_event
        return self._core.lost and event is not None and event.is_set()

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
        connection and its lock; the parent's renewals do not exist here.
        """
        if not self._core.foreign_process():
            return False
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # in a child: only drops our descriptor
        self._op_lock = OpLock()
        self._driver.forget()
        logger.debug("%s was acquired by the parent process; the child ignores it", self._core.what)
        self._core.reset()
        return True

    # ------------------------------------------------------------------ connections
    async def _checkout(self, endpoint: Endpoint | None = None) -> AsyncConnection:
        endpoint = self._core.endpoint if endpoint is None else endpoint
        if self._pool is not None:
            return await self._pool.checkout(endpoint)
        known = self._server if self._server_at == endpoint else None
        conn = await AsyncConnection.connect(endpoint, known)
        self._server, self._server_at = conn.server, endpoint
        return conn

    async def _checkin(self, conn: AsyncConnection) -> None:
        if self._pool is not None:
            await self._pool.checkin(conn)
        else:
            await conn.aclose()

    # ------------------------------------------------------------------ routing
    async def _refresh_map(self, router: ClusterRouter) -> None:
        """Fetch the cluster map from the first seed (or known node) that answers, unless a
        refresh started too recently (`ClusterRouter.claim_refresh`)."""
        if not router.claim_refresh():
            return
        failures: list[str] = []
        for host, port in router.candidates():
            endpoint = self._core.endpoint_at(host, port)
            try:
                conn = await self._checkout(endpoint)
                try:
                    data = await conn.shards()
                finally:
                    await self._checkin(conn)
                if data is None:
                    failures.append(f"{endpoint.address} does not answer shards")
                    continue
                router.update(ClusterMap.parse(data, endpoint.address))
                return
            except DflockError as exc:
                failures.append(str(exc))
        if router.map is None:
            raise ServerUnavailable(
                f"no seed of the cluster answered shards for {self._core.what} "
                f"({'; '.join(failures)}); check servers= (in Celery `dflock_servers`): with "
                "sharding_strategy='cluster' they must be members of the cluster"
            )

    async def _reroute(self, exc: ServerUnavailable) -> None:
        """Cluster routing, after the key's member could not serve the acquire (unreachable,
        its connection closed, draining: a member that died or is leaving; nothing was
        granted): pause, ask for the map again and aim anew, until the acquire's time is up.
        Raises ``exc`` then, and at once in list modes, as ever."""
        core = self._core
        router = core.router
        wait_s = core.on_unreachable(exc)  # the map is read again (now, or by the next acquire)
        if router is None or wait_s is None:
            raise exc
        await pause(wait_s)
        await self._refresh_map(router)
        core.route()

    async def _mismatch(self, conn: AsyncConnection, reply: Reply) -> DflockError:
        """A list-mode client was redirected: ask that server its ``shards`` (on the same
        connection, still in step) for the error that names both lists."""
        try:
            shards = await conn.shards()
        except DflockError:
            shards = None
        else:
            await self._checkin(conn)
        return self._core.mismatch_error(reply, shards)

    # ------------------------------------------------------------------ acquiring
    async def _grant(self, build: _Build, *, keep: bool = True) -> bool:
        self._forked()
        async with self._op_lock:
            core = self._core
            core.begin_acquire()
            try:
                return await self._grant_routed(build, keep)
            finally:
                core.end_acquire()

    async def _grant_routed(self, build: _Build, keep: bool) -> bool:
        """One acquire or enqueue, following a cluster's redirects (operation lock held).
        ``build`` makes the request for the server at hand (what it said to ``hello``).
        Not ``keep``: a grant is neither pinned nor renewed (a detached hold)."""
        core = self._core
        router = core.router
        if router is not None and not core.route():
            await self._refresh_map(router)
            core.route()
        while True:
            try:
                conn = await self._checkout()
            except ServerUnavailable as exc:
                await self._reroute(exc)
                continue
            try:
                command, data, timeout = build(conn.server)
            except BaseException:
                await self._checkin(conn)
                raise
            try:
                sent = time.monotonic()
                reply = await conn.request(command, data, timeout)
            except ServerUnavailable as exc:
                await self._reroute(exc)
                continue
            if core.redirected(reply):
                if router is None:
                    raise await self._mismatch(conn, reply)
                await self._checkin(conn)
                step = core.on_redirect(reply)
                if step is None:
                    return False  # a hand-over outlasted the acquire's time (core.handover)
                if step.reread:
                    router.invalidate()
                await pause(step.pause_s)
                await self._refresh_map(router)  # at most every MAP_REFRESH_INTERVAL_S
                if step.reroute:
                    core.route()
                continue
            try:
                granted = core.on_grant_reply(command, reply, sent, conn.server)
            except ServerDraining as exc:
                await self._checkin(conn)
                await self._reroute(exc)
                continue
            except BaseException:
                await self._checkin(conn)
                raise
            if granted and keep:
                self._start_renewing(conn)
            elif core.state is LockState.ENQUEUED:
                self._conn = conn
            else:
                await self._checkin(conn)
            return granted

    async def acquire(self) -> bool:
        """Take the lock, waiting up to ``acquire_timeout_s`` in FIFO order.

        True when granted (renewal starts), False on timeout. Raises `ServerUnavailable`,
        `AuthError`, `MaxLocksError`, ... when the server cannot or will not answer.
        Interrupting it closes the connection, which also takes it out of the server's queue.
        """
        return await self._grant(self._core.acquire_request)

    async def enqueue(self) -> EnqueueResult:
        """Two-phase step 1: join the queue without blocking.

        ``"acquired"`` if the lock was free and is now held, ``"queued"`` if queued (then call
        `wait`); an `EnqueueResult`, true only when acquired (``if lock.enqueue():`` works).
        `LockNotAcquired` when a cluster hand-over outlasted ``acquire_timeout_s`` (at least
        2 s): neither held nor queued.
        """
        if await self._grant(self._core.enqueue_request):
            return ACQUIRED
        core = self._core
        if core.state is LockState.ENQUEUED:
            return QUEUED
        # Neither: a cluster hand-over kept the key's member from answering until the time
        # was up (a `wait` would find nothing queued).
        raise LockNotAcquired(
            core.handover
            or f"{core.what} was neither acquired nor queued on {core.endpoint.address}"
        )

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Two-phase step 2: wait up to ``timeout_s`` (default ``acquire_timeout_s``).

        True once held (also when `enqueue` already got it). False on timeout; the queue
        position is then given up (its connection is closed).
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
                self._start_renewing(conn)
                return True
            await conn.aclose()  # leave the queue for sure
            return False

    # ------------------------------------------------------------------ renewing
    def _start_renewing(self, conn: AsyncConnection) -> None:
        """After a grant (operation lock held): pin ``conn``, renew, watch it."""
        self._conn = conn
        event = self._lost_event
        if event is not None:
            event.clear()
        core = self._core
        self._driver.start(
            conn, core.renew_interval(), core.first_renewal_in(), f"dflock-renew:{core.key}"
        )

    async def _renew_guarded(self, scheduled: bool) -> bool | None:
        """`_renew_once`, where an unexpected error marks the lock lost instead of escaping
        (the background renewal must never die with a traceback)."""
        try:
            return await self._renew_once(scheduled)
        except Exception as exc:
            logger.exception("unexpected error renewing dflock %s", self._core.what)
            async with self._op_lock:
                first = self._core.mark_lost(f"unexpected error while renewing: {exc!r}")
            if first:
                await self._notify_lost()
            return False

    async def _renew_once(self, scheduled: bool) -> bool | None:
        """One renewal: True renewed, False lost now or before, None nothing to renew
        (``scheduled``: the background renewal's, which does nothing once release began).
        When the held connection is found broken, or breaks during the renewal, the lock is
        reattached (`_reattach`), not lost."""
        core = self._core
        async with self._op_lock:
            conn = self._conn
            if (scheduled and self._driver.cancelled) or core.state is not LockState.HELD:
                return None
            if core.lost:
                return False
            first: bool | None = None  # None: reattach
            if conn is not None and conn.broken_while_idle():
                self._drop_connection(conn, CLOSED_BY_SERVER)
            elif conn is not None:
                outcome = await self._renew_request(conn)
                if outcome.renewed:
                    self._driver.renewed(conn)
                    return True
                if not outcome.reattach:
                    first = core.mark_lost(outcome.lost_reason or "renewal refused")
        if first is None:
            return await self._reattach(scheduled)
        if first:
            await self._notify_lost()
        return False

    def _drop_connection(self, conn: AsyncConnection, detail: str) -> None:
        """The held lock's connection ``conn`` broke (``detail``; operation lock held): close
        it, stop watching it, and have the next renewal reattach."""
        if self._conn is conn:
            self._conn = None
            self._driver.unwatch(conn)
        conn.close()
        self._core.connection_broke(detail)

    async def _renew_request(self, conn: AsyncConnection) -> RenewOutcome:
        """Send one renewal by token on ``conn`` (operation lock held). A connection that
        breaks or drains meanwhile is dropped (the outcome says ``reattach``)."""
        command, data, timeout = self._core.renew_request()
        sent = time.monotonic()
        try:
            reply = await conn.request(command, data, timeout)
        except DflockError as exc:
            self._drop_connection(conn, str(exc))  # the request closed it
            return RenewOutcome(renewed=False, lost_reason=str(exc), reattach=True)
        outcome = self._core.on_renew_reply(reply, sent)
        if outcome.reattach:
            self._drop_connection(conn, outcome.lost_reason or "the server is shutting down")
        return outcome

    async def _reattach(self, scheduled: bool) -> bool | None:
        """The held lock's connection broke: reconnect to its server (a pooled or a new
        connection, with auth, TLS and ``hello`` as usual) and renew by token there, pausing
        between attempts (outside the operation lock). True once renewed (the new connection
        is pinned and watched); False when the renewal is refused or the lease confirmed last
        runs out first (the lock is lost, reported as any loss); None once release began."""
        core = self._core
        while True:
            wait_s: float | None = None
            async with self._op_lock:
                if (scheduled and self._driver.cancelled) or core.state is not LockState.HELD:
                    return None
                if core.lost:
                    return False
                if self._conn is not None:
                    return True  # reattached meanwhile (by `renew`)
                if core.lease_left() <= 0:
                    first = core.mark_unreachable()
                else:
                    outcome = await self._reattach_once()
                    if outcome.renewed:
                        return True
                    if outcome.reattach:
                        wait_s = core.reattach_pause(outcome.lost_reason or "unreachable")
                        first = core.mark_unreachable() if wait_s is None else False
                    else:
                        first = core.mark_lost(outcome.lost_reason or "renewal refused")
            if wait_s is not None:
                await pause(wait_s)
                continue
            if first:
                await self._notify_lost()
            return False

    async def _reattach_once(self) -> RenewOutcome:
        """One attempt of `_reattach` (operation lock held)."""
        try:
            conn = await self._checkout(self._core.reattach_endpoint())
        except AuthError as exc:
            # Answered, and refused: no later attempt does better. Lost now, saying why.
            reason = f"the lock server refused this client's auth when it reconnected ({exc})"
            return RenewOutcome(renewed=False, lost_reason=reason, reattach=False)
        except DflockError as exc:
            return RenewOutcome(renewed=False, lost_reason=str(exc), reattach=True)
        try:
            outcome = await self._renew_request(conn)
        except BaseException:
            conn.close()
            raise
        if outcome.renewed:
            self._conn = conn
            self._driver.attach(conn)
            self._driver.renewed(conn)
        elif not outcome.reattach:
            await self._checkin(conn)  # refused: the connection itself is fine
        return outcome

    async def _request_held(
        self, conn: AsyncConnection | None, build: _Build
    ) -> tuple[Reply, AsyncConnection, bool] | None:
        """Send the request ``build`` makes about the held grant (a release or a hand-off by
        token; operation lock held, renewal stopped) on ``conn``, or, when it is None or
        breaks or the server drains, on a new connection to the lock's server, pausing
        between attempts while the lease runs. Returns the reply, the connection it came on,
        and whether an earlier attempt may have reached the server (its answer lost); None
        when the lease ran out before the server answered."""
        core = self._core
        retried = False
        while True:
            detail = "unreachable"
            if conn is None:
                try:
                    conn = await self._checkout(core.reattach_endpoint())
                except DflockError as exc:
                    detail = str(exc)
            if conn is not None:
                command, data, timeout = build(conn.server)
                try:
                    reply = await conn.request(command, data, timeout)
                except DflockError as exc:  # the request closed the connection
                    retried = True
                    detail = str(exc)
                else:
                    if not core.draining(reply):
                        return reply, conn, retried
                    conn.close()
                    detail = "the server is shutting down"
                conn = None
            core.connection_broke(detail)
            wait_s = core.reattach_pause(detail)
            if wait_s is None:
                return None
            await pause(wait_s)

    async def _notify_lost(self) -> None:
        """Report a loss: `lost_event` (and with it `lost`), then ``on_lost``."""
        self.lost_event.set()
        callback = self._on_lost
        if callback is None:
            return
        try:
            await call_back(callback, self)
        except Exception:
            logger.exception("the on_lost callback of dflock %s raised", self._core.what)

    async def renew(self) -> bool:
        """Renew the lease now (the background renewal does this on its own).

        True if renewed; False if the lock is lost (then `lost` is True, ``on_lost`` ran).
        Raises `LockNotOwned` when not held (also in a fork child of the holder).
        """
        if self._forked():
            raise LockNotOwned(
                f"{self._core.what} was acquired by the parent process before a fork; "
                "a child process cannot renew it (acquire a lock of its own)"
            )
        result = await self._driver.renew_now()
        if result is None:
            raise LockNotOwned(f"{self._core.what} is not held by this object: acquire() it first")
        return result

    # ------------------------------------------------------------------ releasing
    async def release(self) -> bool:
        """Release the lock; True if the server confirmed it. Idempotent.

        Stops the renewal first (waiting for one in flight). When its connection broke, it
        reconnects to the lock's server and releases by token there, pausing between attempts
        while the lease runs; False (logged) if the server could not be reached before the
        lease ran out. False when nothing was held or the lock was lost. If the server no
        longer held the grant (its lease ran out unnoticed, e.g. while the process was paused,
        or it was freed with a closed connection), the lock was lost before this release: it
        is reported as lost (`lost`, `lost_event`, ``on_lost``) first. Leaves a queue after
        `enqueue`. In a fork child of the holder, does nothing (the parent's lock and socket
        are untouched).
        Interrupting it closes the connection, which makes the server release the lock.
        """
        if self._forked():
            return False
        try:
            await self._driver.stop()
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
            self._driver.unwatch(conn)
            conn.close()
        self._core.reset()

    async def _release_locked(self) -> bool:
        conn, self._conn = self._conn, None
        self._driver.unwatch(conn)
        core = self._core
        state = core.state
        if state is LockState.IDLE:
            return False
        if state is LockState.ENQUEUED:
            core.reset()
            if conn is not None:
                await conn.aclose()  # no dequeue command: closing the connection leaves the queue
            return False
        if core.lost:
            core.reset()
            if conn is not None:
                await self._checkin(conn)
            return False
        if conn is not None and conn.broken_while_idle():
            conn.close()
            core.connection_broke(CLOSED_BY_SERVER)
            conn = None
        try:
            sent = await self._request_held(conn, lambda _: core.release_request())
        except BaseException:
            core.reset()  # interrupted: the request closed the connection
            raise
        if sent is None:
            logger.warning(
                "releasing dflock %s: the lock server at %s could not be reached before the "
                "lease ran out (%s); the lease frees it",
                core.what,
                core.endpoint.address,
                redact(core.broken or "unreachable"),
            )
            core.reset()
            return False
        reply, conn, retried = sent
        released = core.on_release_reply(reply, retried=retried)  # refused: marked lost
        await self._checkin(conn)
        return released

    # ------------------------------------------------------------------ context manager
    async def __aenter__(self) -> Self:
        if not await self.acquire():
            core = self._core
            raise LockNotAcquired(
                core.handover
                or f"could not acquire {core.what} on {core.endpoint.address} "
                f"within {core.acquire_timeout_s}s"
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

    # ------------------------------------------------------------------ release by token
    async def release_token(self, token: str) -> bool:
        """Release ``token`` on this key, granted to another object or process (one that died,
        say), through the same release path as `release`; True if the server released it,
        False if it no longer held it. This object holds nothing before or after."""
        self._forked()
        async with self._op_lock:
            core = self._core
            router = core.router
            if router is not None and not core.route():  # cluster: the key's node now
                await self._refresh_map(router)
                core.route()
            core.adopt(token)
            try:
                conn = await self._checkout()
                try:
                    command, data, timeout = self._core.release_request()
                    reply = await conn.request(command, data, timeout)
                    released = self._core.on_release_reply(reply)
                finally:
                    await self._checkin(conn)
            finally:
                self._core.reset()
            return released

    async def _by_token(
        self, build: Callable[[ServerInfo | None], tuple[Command, bytes, float]]
    ) -> bool:
        """One request about a grant this object does not hold (a renew or note by token),
        routed as an acquire is; True done, False when the token no longer holds the key."""
        self._forked()
        async with self._op_lock:
            core = self._core
            router = core.router
            if router is not None and not core.route():
                await self._refresh_map(router)
                core.route()
            conn = await self._checkout()
            try:
                command, data, timeout = build(conn.server)
                reply = await conn.request(command, data, timeout)
            finally:
                await self._checkin(conn)
            return core.on_token_reply(command, reply)

    async def renew_token(self, token: str, lease_ttl: int) -> bool:
        """Renew ``token`` on this key (granted to any object or process) to ``lease_ttl``
        seconds from now; True if renewed, False if it no longer holds the key."""
        return await self._by_token(lambda _: self._core.token_renew_request(token, lease_ttl))

    async def detach_token(self, token: str, lease_ttl: int) -> bool:
        """Detach ``token``'s grant on this key from the connection it is bound to (``hd``),
        with a lease of ``lease_ttl`` seconds from now; True if done, False if it no longer
        holds the key. `HoldsUnsupported` for a server without holds."""
        return await self._by_token(
            lambda server: self._core.detach_token_request(server, token, lease_ttl)
        )

    async def note_token(self, token: str, note: str) -> bool:
        """Replace the owner note of ``token``'s grant on this key; True if done, False if
        it no longer holds the key. `HoldsUnsupported` for a server without holds."""
        return await self._by_token(lambda server: self._core.note_request(server, token, note))


class AsyncDistributedLock(_AsyncLockBase):
    """A distributed lock, renewed in the background while held (the dflockd client's
    parameters, in its order; ``pool`` shares connections and renewals between locks).

    ``sharding_strategy="cluster"``: ``servers`` are seeds of a cluster (``dflockd
    --cluster``); the key goes to the member its shard map names, redirects are followed.
    ``router`` shares one cached map between locks (a `Client` passes its own); without it
    the lock fetches a map of its own.
    """

    def __init__(  # noqa: PLR0917 - positional order is the dflockd client's
        self,
        key: str,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: float | None = None,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        sharding_strategy: Routing = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        *,
        auth_token: str | None = None,
        ssl_context: SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        on_lost: Callable[[Self], object] | None = None,
        pool: AsyncConnectionPool | None = None,
        router: ClusterRouter | None = None,
        note: str | None = None,
    ) -> None:
        core = LockCore(
            key,
            None,
            acquire_timeout_s,
            lease_ttl_s,
            servers,
            sharding_strategy,
            renew_ratio,
            auth_token,
            ssl_context,
            connect_timeout_s,
            router,
            note,
        )
        super().__init__(core, on_lost, pool)

    @property
    def note(self) -> str | None:
        """The owner note each acquire sends to a server with holds (None: none)."""
        return self._core.note

    async def hold(self, note: str, *, detached: bool = True) -> Hold:
        """Take a detached hold of this key (``hl ... d <note>``), waiting up to
        ``acquire_timeout_s``, with this lock's lease: the grant outlives this object and its
        connection, and is neither renewed nor released here. Not ``detached``: the grant
        (``hl ... c``) stays bound to the pooled connection that took it (freed if that
        connection closes) until `detach_token` detaches it. Raises `KeyHeld` when the key
        stays busy, `HoldsUnsupported` for a server without holds. This object holds nothing
        after."""
        core = self._core
        try:
            if not await self._grant(
                lambda server: core.hold_request(server, note, detached=detached), keep=False
            ):
                if core.busy:
                    holder = core.holder
                    by = "" if holder is None else f" (its holder's note: {holder!r})"
                    raise KeyHeld(
                        f"{core.what} is held on {core.endpoint.address}{by}; it stayed busy "
                        f"for the {core.acquire_timeout_s}s the hold could wait",
                        core.key,
                        holder,
                    )
                raise LockNotAcquired(
                    core.handover
                    or f"no cluster member served {core.what} within "
                    f"{core.acquire_timeout_s}s; retry shortly"
                )
            token = core.token
            assert token is not None
            return Hold(core.key, token, core.fence, core.lease, core.endpoint.address)
        finally:
            if core.state is LockState.HELD:
                core.reset()

    async def adopt(
        self, token: str, *, note: str | None = None, on_close_lease: int | None = None
    ) -> bool:
        """Take over ``token``, a detached grant of this key (a hold), exclusively (``ht``): the
        server binds it to this object's connection, with this lock's lease and the owner
        ``note`` (default: the lock's `note`; one of them is needed). From then on this object
        holds it exactly as after `acquire` (the token's fence, renewal, loss detection,
        `release`). If the connection dies first, the grant is released (``on_close_lease``
        None) or detached again with a lease of ``on_close_lease`` seconds, for the next
        `adopt` of the same token. False, holding nothing, when the token no longer holds the
        key or another connection has it bound (`holder` then tells that holder's note).
        `HoldsUnsupported` for a server without holds."""
        core = self._core
        ht_note = core.take_over_note(note)
        close_lease = (
            None
            if on_close_lease is None
            else whole_seconds("on_close_lease", on_close_lease, minimum=1)
        )
        self._forked()
        async with self._op_lock:
            router = core.router
            if router is not None and not core.route():
                await self._refresh_map(router)
                core.route()
            conn = await self._checkout()
            try:
                command, data, timeout = core.take_over_request(
                    conn.server, token, ht_note, close_lease
                )
                sent = time.monotonic()
                reply = await conn.request(command, data, timeout)
                held = core.on_take_over_reply(token, reply, sent, conn.server)
            except BaseException:
                core.reset()
                await self._checkin(conn)
                raise
            if not held:
                await self._checkin(conn)
                return False
            self._start_renewing(conn)
            return True

    async def hand_off(self, lease_ttl: int) -> bool:
        """Let go of the held grant without releasing it (``hd``): the server detaches it from
        this object's connection with a lease of ``lease_ttl`` seconds from now; this object
        stops renewing and forgets its token (a later `release` is a no-op returning False,
        and not a loss). True when the server did. The grant is then a hold any process can
        `adopt` or release by its token. (A server without holds: a last renewal to
        ``lease_ttl``, the grant stays bound to the connection, back in the pool.) When the
        held connection broke, it reconnects and hands off by token, as `release` does."""
        lease = whole_seconds("lease_ttl", lease_ttl, minimum=1)
        if self._forked() or not self._core.locked():
            return False
        await self._driver.stop()
        async with self._op_lock:
            core = self._core
            conn, self._conn = self._conn, None
            self._driver.unwatch(conn)
            if core.state is not LockState.HELD or core.lost:
                core.reset()
                if conn is not None:
                    await self._checkin(conn)
                return False
            if conn is not None and conn.broken_while_idle():
                conn.close()
                core.connection_broke(CLOSED_BY_SERVER)
                conn = None
            try:
                sent = await self._request_held(
                    conn, lambda server: core.hand_off_request(lease, server)
                )
            except BaseException:
                core.reset()
                raise
            broken = core.broken
            core.reset()
            if sent is None:
                logger.warning(
                    "handing off dflock %s: the lock server at %s could not be reached "
                    "before the lease ran out (%s)",
                    core.what,
                    core.endpoint.address,
                    redact(broken or "unreachable"),
                )
                return False
            reply, conn, _ = sent
            await self._checkin(conn)
            return isinstance(reply, Renewed | protocol.Ok)


class AsyncDistributedSemaphore(_AsyncLockBase):
    """Up to ``limit`` holders of one key at once (the semaphore twin of the lock)."""

    def __init__(  # noqa: PLR0917 - positional order is the dflockd client's
        self,
        key: str,
        limit: int,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: float | None = None,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        sharding_strategy: Routing = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        *,
        auth_token: str | None = None,
        ssl_context: SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        on_lost: Callable[[Self], object] | None = None,
        pool: AsyncConnectionPool | None = None,
        router: ClusterRouter | None = None,
    ) -> None:
        core = LockCore(
            key,
            limit,
            acquire_timeout_s,
            lease_ttl_s,
            servers,
            sharding_strategy,
            renew_ratio,
            auth_token,
            ssl_context,
            connect_timeout_s,
            router,
        )
        super().__init__(core, on_lost, pool)

    @property
    def limit(self) -> int:
        """The semaphore's number of slots."""
        assert self._core.limit is not None
        return self._core.limit
