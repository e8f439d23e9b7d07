"""Locks and semaphores renewed in the background (asyncio source of the ``_sync/`` twin).

The I/O-free `celery_dflock.client._core.LockCore` decides; a lock object carries it out:
getting a grant, requests by token and letting go, routed to the key's server (following a
cluster's redirects). Its holding (``held.py``) keeps the grant alive."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from ssl import SSLContext
from types import TracebackType
from typing import Self

from celery_dflock.client import _by_token, _requests, errors
from celery_dflock.client._aio_backend import Event, check_callback, pause
from celery_dflock.client._async.connection import ENQUEUING, AsyncConnection
from celery_dflock.client._async.held import AsyncHolding, unreached
from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._async.routing import Build, refresh_map, request_once
from celery_dflock.client._core import ACQUIRED, QUEUED, EnqueueResult, LockCore
from celery_dflock.client._grant import LockState
from celery_dflock.client._replies import Asked, Ok, Queued, Renewed, Reply, TimedOut
from celery_dflock.client._router import ClusterRouter
from celery_dflock.client._servers import Hold
from celery_dflock.client._settings import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    DEFAULT_SESSION_TTL_S,
    ClientSettings,
    check_limit,
    lease_seconds,
    whole_seconds,
)
from celery_dflock.client.sharding import Routing, stable_hash_shard

__all__ = ["AsyncDistributedLock", "AsyncDistributedSemaphore", "AsyncLockBase"]


class AsyncLockBase:
    """What a lock and a semaphore share, over a `LockCore` and an `AsyncHolding`."""

    def _setup(
        self,
        core: LockCore,
        on_lost: Callable[[Self], object] | None,
        pool: AsyncConnectionPool | None,
    ) -> None:
        if on_lost is not None and not callable(on_lost):
            raise errors.InvalidValueError(
                f"on_lost must be a callable taking the lock, got {on_lost!r}"
            )
        if on_lost is not None:
            check_callback(on_lost)
        self._core = core
        self._holding = AsyncHolding(
            core, None if on_lost is None else partial(on_lost, self), pool
        )

    @classmethod
    def _of(
        cls,
        core: LockCore,
        on_lost: Callable[[Self], object] | None,
        pool: AsyncConnectionPool | None,
    ) -> Self:
        """A lock around ``core`` (a client's, settings checked already)."""
        lock = cls.__new__(cls)
        lock._setup(core, on_lost, pool)
        return lock

    @property
    def lost_event(self) -> Event:
        """Set when the held lock is lost (cleared by the next successful acquire)."""
        return self._holding.lost_event

    @property
    def key(self) -> str:
        return self._core.key

    @property
    def server(self) -> tuple[str, int]:
        """The ``(host, port)`` this key is routed to."""
        return self._core.endpoint.host, self._core.endpoint.port

    @property
    def holder(self) -> str | None:
        """After an acquire refused on a busy key: its holder's note (servers with holds)."""
        return self._core.holder

    @property
    def handover(self) -> str | None:
        """Why the last acquire failed when a cluster hand-over outlasted its time (else None)."""
        return self._core.routing.handover

    @property
    def grace(self) -> str | None:
        """Why the last acquire (or two-phase wait) failed when its server was in its restart grace,
        granting no key until every lease its previous run may have granted ended (else None)."""
        return self._core.grace

    @property
    def token(self) -> str | None:
        """The current grant's token (a bearer credential: do not log it), or None."""
        return self._core.grant.token

    @property
    def lease(self) -> int:
        """Lease of the current (or last) grant in seconds."""
        return self._core.grant.lease

    @property
    def fence(self) -> int | None:
        """Fencing counter of the current grant (``int(token[:16], 16)``, grows per grant);
        None when not held or the server's tokens are random (dflockd 0.4/0.5, the Go one)."""
        return self._core.grant.fence

    @property
    def lost(self) -> bool:
        """True once the held lock could not be renewed (until the next acquire); set with
        `lost_event`, just before ``on_lost`` runs."""
        return self._holding.lost

    def locked(self) -> bool:
        """True while held by this object in this process (acquired, not released)."""
        return self._core.locked()

    def owned(self) -> bool:
        """`locked`, not `lost`, and the grant known to be still held: the lease runs and, on a
        session connection, the server answered a request sent less than its session time
        (less a margin) ago. After a longer pause, False until a renewal is answered."""
        return self._core.owned()

    async def acquire(self) -> bool:
        """Take the lock, waiting up to ``acquire_timeout_s`` in FIFO order: True when granted
        (renewal starts), False on timeout. Interrupting it closes the connection (leaving
        the server's queue)."""
        return await self._grant(self._core.acquire_request)

    async def enqueue(self) -> EnqueueResult:
        """Two-phase step 1: join the queue without blocking: ``"acquired"`` (held now) or
        ``"queued"`` (then call `wait`). `LockNotAcquired` when a cluster hand-over outlasted
        ``acquire_timeout_s``: neither held nor queued. Interrupted (a signal's exception, a
        cancellation), it leaves the queue."""
        core = self._core
        queued = core.state is LockState.ENQUEUED  # before: refused below, its place kept
        try:
            if await self._grant(core.enqueue_request):
                return ACQUIRED
            if core.state is LockState.ENQUEUED:
                return QUEUED
        except BaseException:
            if core.state is LockState.ENQUEUED and not queued:  # its caller never learns of it
                async with self._holding.op_lock:
                    await self._holding.release_locked()
            raise
        raise errors.LockNotAcquired(
            core.routing.handover
            or f"{core.what} was neither acquired nor queued on {core.endpoint.address}"
        )

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Two-phase step 2: wait up to ``timeout_s`` (default ``acquire_timeout_s``): True once
        held; False on timeout, the queue position given up."""
        holding, core = self._holding, self._core
        holding.forked()
        held = None  # held before this call (None: not known yet)
        try:
            async with holding.op_lock:
                if held := core.state is LockState.HELD:
                    if timeout_s is not None:  # a wrong one is named here too
                        whole_seconds("timeout_s", timeout_s, minimum=0)
                    return True
                command, data, timeout = core.wait_request(timeout_s)
                conn, holding.conn = holding.conn, None
                assert conn is not None  # ENQUEUED: its connection is kept (`_grant_routed`)
                holding.keep_while_waiting(conn, True)  # (enqueued: kept alive since the enqueue)
                sent = time.monotonic()
                try:
                    try:
                        reply = await conn.request(command, data, timeout)
                    finally:
                        holding.keep_while_waiting(conn, False)
                    if isinstance(reply, TimedOut):
                        await conn.learn_grace()
                    granted = core.on_grant_reply(command, reply, sent, conn.server, conn.session)
                except BaseException:
                    if core.locked():  # granted: its connection closed by `_drop_interrupted`
                        holding.conn = conn
                    else:
                        core.reset()
                        conn.close()
                    raise
                if granted:
                    return await holding.start_renewing(conn)
                await conn.aclose()  # leave the queue for sure
                return False
        except BaseException as exc:
            if held is False:
                await self._drop_interrupted(exc)
            raise

    async def _grant(self, build: Build, *, keep: bool = True) -> bool:
        """An acquire or enqueue of ``build``'s request; not ``keep``: a detached hold."""
        holding = self._holding
        holding.forked()
        held = None  # held before this call (None: not known yet)
        try:
            async with holding.op_lock:
                held = self._core.state is LockState.HELD  # (then refused: not ours to drop)
                self._core.begin_acquire()
                try:
                    return await self._grant_routed(build, keep)
                finally:
                    self._core.routing.end_acquire()
        except BaseException as exc:
            if held is False:
                await self._drop_interrupted(exc)
            raise

    async def _drop_interrupted(self, exc: BaseException) -> None:
        """An acquire or wait interrupted (a signal's exception, a cancellation): a grant the
        lock holds is released in the background (nobody else would); one a signal's
        exception may have lost between its reply's read and the lock retires its session."""
        holding = self._holding
        if self._core.state is LockState.HELD:
            await holding.driver.stop()
            async with holding.op_lock:
                holding.abandon()
        elif isinstance(exc, Exception | KeyboardInterrupt | SystemExit) and not isinstance(
            exc, errors.DflockError
        ):
            holding.retire_session()

    async def _grant_routed(self, build: Build, keep: bool) -> bool:
        """`_grant`, following a cluster's redirects (operation lock held)."""
        holding, core = self._holding, self._core
        router = core.routing.router
        await self._route()
        while True:
            try:
                conn = await holding.checkout()
            except errors.ServerUnavailable as exc:
                await self._reroute(exc)
                continue
            try:
                command, data, timeout = build(conn.server)
            except BaseException:
                await holding.checkin(conn)
                raise
            try:
                if core.routing.asking:
                    core.routing.asking = False  # one request only
                    asking = _requests.checked_asking(core.key, core.routing.ask_ticket)
                    if not isinstance(await conn.request(_requests.Command.ASKING, asking), Ok):
                        await holding.checkin(conn)
                        wait_s = core.routing.on_ask_refused()
                        if wait_s is None:
                            return False
                        await pause(wait_s)
                        core.routing.route()
                        continue
                # One that may wait for its grant: its session is kept alive meanwhile.
                waits = core.routing.acquire_timeout_s > 0 or command in ENQUEUING
                holding.keep_while_waiting(conn, waits)
                sent = time.monotonic()
                try:
                    reply = await conn.request(command, data, timeout)
                finally:
                    holding.keep_while_waiting(conn, False)
            except errors.ServerUnavailable as exc:
                await self._reroute(exc)
                continue
            try:  # (an interruption here, the reply read: its connection is closed)
                asked = isinstance(reply, Asked)  # a key-level move: this key, once, there
                if (asked and router is not None) or core.routing.redirected(reply):
                    if router is None:
                        raise await self._mismatch(conn, reply)
                    await holding.checkin(conn)
                    step = core.routing.on_ask(reply) if asked else core.routing.on_redirect(reply)
                    if step is None:
                        return False  # a hand-over outlasted the acquire's time (routing.handover)
                    if step.reread:  # (asked in a loop: rerouted, always reread)
                        router.invalidate()
                    if step.reroute or not asked:  # (an ask followed at once: the map stays)
                        await pause(step.pause_s)
                        await self._remap(router, route=step.reroute)
                    continue
                if isinstance(reply, TimedOut):
                    await conn.learn_grace()
                try:
                    granted = core.on_grant_reply(command, reply, sent, conn.server, conn.session)
                except errors.ServerDraining as exc:
                    await holding.checkin(conn)
                    await self._reroute(exc)
                    continue
                except BaseException:
                    await holding.checkin(conn)
                    raise
                if granted and keep:
                    granted = await holding.start_renewing(conn)
                elif core.state is LockState.ENQUEUED:
                    holding.conn = conn
                else:
                    await holding.checkin(conn)
                return granted
            except BaseException:
                if isinstance(reply, Queued):  # interrupted once queued: `enqueue` leaves it
                    core.state, holding.conn = LockState.ENQUEUED, conn
                elif holding.conn is not conn:
                    conn.close()
                raise

    async def _remap(self, router: ClusterRouter, *, route: bool = True) -> None:
        """Read the map again (at most every MAP_REFRESH_INTERVAL_S); ``route``: aim by it."""
        holding = self._holding
        await refresh_map(
            router, holding.checkout, holding.checkin, self._core.routing.settings, self._core.what
        )
        if route:
            self._core.routing.route()

    async def _route(self) -> None:
        """Aim at the key's server (in cluster mode by the map, read first if not fresh)."""
        router = self._core.routing.router
        if router is not None and not self._core.routing.route():
            await self._remap(router)

    async def _reroute(self, exc: errors.ServerUnavailable) -> None:
        """The key's member could not serve the acquire: pause and re-route until the acquire's
        time is up, then raise ``exc`` (at once in list modes)."""
        core = self._core
        wait_s = core.routing.on_unreachable(exc)  # the map is read again (now, or next acquire)
        if core.routing.router is None or wait_s is None:
            raise exc
        await pause(wait_s)
        await self._remap(core.routing.router)

    async def _mismatch(self, conn: AsyncConnection, reply: Reply) -> errors.DflockError:
        """A list-mode client was redirected: the error naming both server lists."""
        try:
            shards = await conn.shards()
        except errors.DflockError:
            shards = None
        else:
            await self._holding.checkin(conn)
        return self._core.routing.mismatch_error(reply, shards)

    async def renew(self) -> bool:
        """Renew the lease now: True if renewed, False if lost. `LockNotOwned` when not held
        (also in a fork child of the holder)."""
        holding, what = self._holding, self._core.what
        if holding.forked():
            raise errors.LockNotOwned(
                f"{what} was acquired by the parent process before a fork; "
                "a child process cannot renew it (acquire a lock of its own)"
            )
        result = await holding.driver.renew_now()
        if result is None:
            raise errors.LockNotOwned(f"{what} is not held by this object: acquire() it first")
        return result

    async def release(self) -> bool:
        """Release the lock; True if the server confirmed it. Idempotent.

        False when nothing was held or the lock was lost. An enqueued lock leaves the queue (a grant
        that came meanwhile is released: True). A server that does not answer: False (at once when
        it is down; when it is silent, after the 10 s reply timeout, and a renewal then in flight
        first waits out its own), and the background keeps releasing by token while the lease runs.
        If the server no longer held the grant, the loss is reported first (`lost`, ``on_lost``). A
        fork child of the holder does nothing."""
        holding, core = self._holding, self._core
        if holding.forked():
            return False
        holding.driver.check()  # unasync: async only
        try:
            await holding.driver.stop()
            async with holding.op_lock:
                released = await holding.release_locked()
                lost_here = core.lost and core.state is LockState.HELD
            if lost_here:
                # Notified outside the operation lock: the callback may use the lock.
                await holding.notify_lost()
                async with holding.op_lock:
                    if core.lost and core.state is LockState.HELD:
                        core.reset()
            return released
        except BaseException:
            holding.abandon()
            raise

    async def __aenter__(self) -> Self:
        if not await self._grant(self._core.acquire_request):
            core = self._core
            raise errors.LockNotAcquired(
                core.routing.handover
                or core.grace
                or f"could not acquire {core.what} on {core.endpoint.address} "
                f"within {core.routing.acquire_timeout_s}s"
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()

    async def note_token(self, token: str, note: str) -> bool:
        """Replace the owner note of ``token``'s grant on this key; False if it no longer
        holds the key. Sent to the held grant's server, else routed as an acquire is."""
        token, note = _requests.validate_token(token), _requests.validate_note(note)
        holding, core = self._holding, self._core
        holding.forked()
        async with holding.op_lock:
            if core.state is not LockState.HELD:  # held: at its grant's server, kept there
                await self._route()  # cluster: the key's node now
            while True:
                command, reply = await request_once(
                    holding.checkout,
                    holding.checkin,
                    core.endpoint,
                    partial(_by_token.note_request, key=core.key, token=token, note=note),
                )
                found = _by_token.done(command, reply, core.key, core.endpoint)
                # Not known at the key's node: maybe at its moving shard's target.
                if found or core.state is LockState.HELD or not core.routing.to_target():
                    return found

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.describe()})"


class AsyncDistributedLock(AsyncLockBase):
    """A distributed lock, renewed in the background while held (the dflockd client's
    parameters, in its order; ``pool`` shares connections and renewals between locks).

    ``sharding_strategy="cluster"``: ``servers`` are seeds of a cluster; ``router`` shares
    one cached shard map between locks (else the lock fetches its own)."""

    def __init__(  # noqa: PLR0917 - positional order is the dflockd client's
        self,
        key: str,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: int | None = None,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        sharding_strategy: Routing = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        *,
        auth_token: str | None = None,
        ssl_context: SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        on_lost: Callable[[Self], object] | None = None,
        pool: AsyncConnectionPool | None = None,
        router: ClusterRouter | None = None,
        note: str | None = None,
    ) -> None:
        settings = ClientSettings.checked(
            servers,
            sharding_strategy,
            renew_ratio,
            auth_token,
            ssl_context,
            connect_timeout_s,
            acquire_timeout_s,
            lease_ttl_s,
            session_ttl_s,
        )
        self._setup(LockCore(key, settings, router=router, note=note), on_lost, pool)

    @property
    def note(self) -> str | None:
        """The owner note each acquire sends to a server with holds (None: none)."""
        return self._core.note

    async def hold(self, note: str, *, detached: bool = True) -> Hold:
        """Take a detached hold of this key (``hl ... d <note>``) with this lock's lease: the grant
        outlives this object, which holds nothing after. Not ``detached``: it stays bound to the
        pooled connection that took it until `Client.detach`. `KeyHeld` when the key stays busy."""
        note = _requests.validate_note(note)
        if not isinstance(detached, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise errors.InvalidValueError(f"detached must be True or False, got {detached!r}")
        core, granted = self._core, False
        try:
            granted = await self._grant(
                lambda server: core.hold_request(server, note, detached=detached), keep=False
            )
            if not granted:
                if core.busy:
                    holder = core.holder
                    by = "" if holder is None else f" (its holder's note: {holder!r})"
                    raise errors.KeyHeld(
                        f"{core.what} is held on {core.endpoint.address}{by}; it stayed busy "
                        f"for the {core.routing.acquire_timeout_s}s the hold could wait",
                        core.key,
                        holder,
                    )
                raise errors.LockNotAcquired(
                    core.routing.handover
                    or f"no cluster member served {core.what} within "
                    f"{core.routing.acquire_timeout_s}s; retry shortly"
                )
            token = core.grant.token
            assert token is not None
            return Hold(core.key, token, core.grant.fence, core.grant.lease, core.endpoint.address)
        finally:
            if granted:  # the hold's, not a grant this lock held before
                core.reset()

    async def adopt(
        self, token: str, *, note: str | None = None, on_close_lease: int | None = None
    ) -> bool:
        """Take over ``token``, a hold of this key (``ht``), bound to this object's connection
        with this lock's lease and owner ``note`` (default: the lock's): then held as after
        `acquire`. If the connection dies, the grant is released (``on_close_lease`` None)
        or detached again with that lease. False when the token no longer holds the key or
        another connection has it bound (`holder` names it)."""
        holding, core = self._holding, self._core
        token = _requests.validate_token(token)
        ht_note = core.take_over_note(note)
        close_lease = (
            None if on_close_lease is None else lease_seconds("on_close_lease", on_close_lease)
        )
        holding.forked()
        async with holding.op_lock:
            core.require_idle()  # (a failure below resets the core)
            await self._route()
            while True:
                conn = await holding.checkout()
                try:
                    command, data, timeout = core.take_over_request(
                        conn.server, token, ht_note, close_lease
                    )
                    sent = time.monotonic()
                    reply = await conn.request(command, data, timeout)
                    held = core.on_take_over_reply(token, reply, sent, conn.server, conn.session)
                except BaseException:
                    core.reset()
                    await holding.checkin(conn)
                    raise
                if held:
                    break
                await holding.checkin(conn)
                # Not known here: a hold of a shard moving key by key may be at its target.
                if core.busy or not core.routing.to_target():
                    return False
            return await holding.start_renewing(conn)

    async def hand_off(self, lease_ttl: int) -> bool:
        """Let go of the held grant without releasing it (``hd``): detached with a lease of
        ``lease_ttl`` seconds, a hold any process can `adopt`; True when done. A server
        without holds gets a last renewal to ``lease_ttl`` instead."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        holding, core = self._holding, self._core
        if holding.forked() or not core.locked():
            return False
        core.check_lease(holding.server(), lease)  # refused before the lock lets go of anything
        await holding.driver.stop()
        async with holding.op_lock:
            conn, holding.conn = holding.conn, None
            holding.driver.unwatch(conn)
            if core.state is not LockState.HELD or core.lost:
                return await holding.let_go(conn)
            try:
                sent = await holding.request_held(
                    conn, lambda server: core.hand_off_request(lease, server)
                )
                broken = core.grant.broken
            finally:
                core.reset()
            if sent is None:
                unreached("handing off", core, broken)
                return False
            reply, conn, _ = sent
            await holding.checkin(conn)
            return isinstance(reply, Renewed | Ok)


class AsyncDistributedSemaphore(AsyncLockBase):
    """Up to ``limit`` holders of one key at once (the semaphore twin of the lock)."""

    def __init__(  # noqa: PLR0917 - positional order is the dflockd client's
        self,
        key: str,
        limit: int,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: int | None = None,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        sharding_strategy: Routing = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        *,
        auth_token: str | None = None,
        ssl_context: SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        on_lost: Callable[[Self], object] | None = None,
        pool: AsyncConnectionPool | None = None,
        router: ClusterRouter | None = None,
    ) -> None:
        settings = ClientSettings.checked(
            servers,
            sharding_strategy,
            renew_ratio,
            auth_token,
            ssl_context,
            connect_timeout_s,
            acquire_timeout_s,
            lease_ttl_s,
            session_ttl_s,
        )
        core = LockCore(key, settings, limit=check_limit(limit, semaphore=True), router=router)
        self._setup(core, on_lost, pool)

    @property
    def limit(self) -> int:
        """The semaphore's number of slots."""
        assert self._core.routing.limit is not None
        return self._core.routing.limit
