"""Acquiring: how a lock object gets a grant (acquire, two-phase enqueue / wait, a detached
hold, taking over a hold by its token) and sends requests by token, routed to the key's server
and following a cluster's redirects; a grant it gets is handed to the lock's holding
(`celery_dflock.client._async.held.AsyncHolding`), which keeps it. Functions over that
holding: the lock object owns the holding, and acquiring needs nothing of its own.

Written once for both faces: the asyncio source, ``celery_dflock/client/_async/acquiring.py``,
and the blocking twin that ``scripts/unasync.py`` generates from it in ``_sync/``. The routing
decisions are `LockCore`'s (`celery_dflock.client._router.KeyRoute`); this module only moves
the bytes.
"""

from __future__ import annotations

import time

from celery_dflock.client import _by_token, _requests
from celery_dflock.client._aio_backend import pause
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._async.held import AsyncHolding
from celery_dflock.client._async.routing import Build, refresh_map, request_once
from celery_dflock.client._core import ACQUIRED, QUEUED, EnqueueResult, LockCore
from celery_dflock.client._grant import LockState
from celery_dflock.client._replies import Asked, Ok, Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._router import ClusterRouter
from celery_dflock.client.errors import (
    DflockError,
    LockNotAcquired,
    LockNotOwned,
    ServerDraining,
    ServerUnavailable,
)


# ---------------------------------------------------------------------- routing
async def _refresh_map(holding: AsyncHolding, router: ClusterRouter) -> None:
    """Fetch the cluster map (`refresh_map`), on this lock's connections."""
    core = holding.core
    await refresh_map(router, holding.checkout, holding.checkin, core.settings, core.what)


async def _reroute(holding: AsyncHolding, exc: ServerUnavailable) -> None:
    """Cluster routing, after the key's member could not serve the acquire (unreachable,
    its connection closed, draining: a member that died or is leaving; nothing was
    granted): pause, ask for the map again and aim anew, until the acquire's time is up.
    Raises ``exc`` then, and at once in list modes, as ever."""
    core = holding.core
    router = core.router
    wait_s = core.routing.on_unreachable(exc)  # the map is read again (now, or by the next acquire)
    if router is None or wait_s is None:
        raise exc
    await pause(wait_s)
    await _refresh_map(holding, router)
    core.routing.route()


async def _mismatch(holding: AsyncHolding, conn: AsyncConnection, reply: Reply) -> DflockError:
    """A list-mode client was redirected: ask that server its ``shards`` (on the same
    connection, still in step) for the error that names both lists."""
    try:
        shards = await conn.shards()
    except DflockError:
        shards = None
    else:
        await holding.checkin(conn)
    return holding.core.routing.mismatch_error(reply, shards)


# ---------------------------------------------------------------------- acquiring
async def grant(holding: AsyncHolding, build: Build, *, keep: bool = True) -> bool:
    holding.forked()
    async with holding.op_lock:
        core = holding.core
        core.begin_acquire()
        try:
            return await _grant_routed(holding, build, keep)
        finally:
            core.routing.end_acquire()


async def _grant_routed(holding: AsyncHolding, build: Build, keep: bool) -> bool:
    """One acquire or enqueue, following a cluster's redirects (operation lock held).
    ``build`` makes the request for the server at hand (what it said to ``hello``).
    Not ``keep``: a grant is neither pinned nor renewed (a detached hold)."""
    core = holding.core
    router = core.router
    if router is not None and not core.routing.route():
        await _refresh_map(holding, router)
        core.routing.route()
    while True:
        try:
            conn = await holding.checkout()
        except ServerUnavailable as exc:
            await _reroute(holding, exc)
            continue
        try:
            command, data, timeout = build(conn.server)
        except BaseException:
            await holding.checkin(conn)
            raise
        try:
            if core.asking:
                core.asking = False  # one request only
                if not isinstance(
                    await conn.request(
                        Command.ASKING, _requests.encode_asking(core.key, core.ask_ticket)
                    ),
                    Ok,
                ):
                    await holding.checkin(conn)
                    wait_s = core.routing.on_ask_refused()
                    if wait_s is None:
                        return False
                    await pause(wait_s)
                    core.routing.route()
                    continue
            holding.keep_while_waiting(conn, _may_wait(core, command))
            sent = time.monotonic()
            try:
                reply = await conn.request(command, data, timeout)
            finally:
                holding.keep_while_waiting(conn, False)
        except ServerUnavailable as exc:
            await _reroute(holding, exc)
            continue
        if isinstance(reply, Asked) and router is not None:
            await holding.checkin(conn)
            step = core.routing.on_ask(reply)  # a key-level move: this key, once, there
            if step is None:
                return False  # a hand-over outlasted the acquire's time (core.handover)
            if step.reroute:  # asked in a loop: read the map again, route by it
                router.invalidate()
                await pause(step.pause_s)
                await _refresh_map(holding, router)
                core.routing.route()
            continue
        if core.redirected(reply):
            if router is None:
                raise await _mismatch(holding, conn, reply)
            await holding.checkin(conn)
            step = core.routing.on_redirect(reply)
            if step is None:
                return False  # a hand-over outlasted the acquire's time (core.handover)
            if step.reread:
                router.invalidate()
            await pause(step.pause_s)
            await _refresh_map(holding, router)  # at most every MAP_REFRESH_INTERVAL_S
            if step.reroute:
                core.routing.route()
            continue
        try:
            granted = core.on_grant_reply(command, reply, sent, conn.server, conn.session)
        except ServerDraining as exc:
            await holding.checkin(conn)
            await _reroute(holding, exc)
            continue
        except BaseException:
            await holding.checkin(conn)
            raise
        if granted and keep:
            await holding.start_renewing(conn)
        elif core.state is LockState.ENQUEUED:
            holding.conn = conn
        else:
            await holding.checkin(conn)
        return granted


def _may_wait(core: LockCore, command: Command) -> bool:
    """Whether the acquire ``command`` may leave the lock waiting for its grant (a wait in
    the queue, or an enqueue): its client session is then kept alive meanwhile."""
    return core.acquire_timeout_s > 0 or command in (Command.ENQUEUE, Command.SEM_ENQUEUE)


async def enqueue(holding: AsyncHolding) -> EnqueueResult:
    """Two-phase step 1: join the queue without blocking.

    ``"acquired"`` if the lock was free and is now held, ``"queued"`` if queued (then call
    `wait`); an `EnqueueResult`, true only when acquired (``if lock.enqueue():`` works).
    `LockNotAcquired` when a cluster hand-over outlasted ``acquire_timeout_s`` (at least
    2 s): neither held nor queued.
    """
    if await grant(holding, holding.core.enqueue_request):
        return ACQUIRED
    core = holding.core
    if core.state is LockState.ENQUEUED:
        return QUEUED
    # Neither: a cluster hand-over kept the key's member from answering until the time
    # was up (a `wait` would find nothing queued).
    raise LockNotAcquired(
        core.handover or f"{core.what} was neither acquired nor queued on {core.endpoint.address}"
    )


async def wait(holding: AsyncHolding, timeout_s: float | None = None) -> bool:
    """Two-phase step 2: wait up to ``timeout_s`` (default ``acquire_timeout_s``).

    True once held (also when `enqueue` already got it). False on timeout; the queue
    position is then given up (its connection is closed).
    """
    holding.forked()
    async with holding.op_lock:
        if holding.core.state is LockState.HELD:
            return True
        command, data, timeout = holding.core.wait_request(timeout_s)
        conn, holding.conn = holding.conn, None
        if conn is None:  # pragma: no cover - ENQUEUED always has a connection
            holding.core.reset()
            raise LockNotOwned(f"{holding.core.what} lost its queue connection")
        holding.keep_while_waiting(conn, True)  # (enqueued: kept alive since the enqueue)
        sent = time.monotonic()
        try:
            try:
                reply = await conn.request(command, data, timeout)
            finally:
                holding.keep_while_waiting(conn, False)
            granted = holding.core.on_grant_reply(command, reply, sent, conn.server, conn.session)
        except BaseException:
            holding.core.reset()
            conn.close()
            raise
        if granted:
            await holding.start_renewing(conn)
            return True
        await conn.aclose()  # leave the queue for sure
        return False


async def take_over(holding: AsyncHolding, token: str, note: str, close_lease: int | None) -> bool:
    """The lock's `adopt`, its arguments checked: take over ``token``'s detached grant
    (``ht``) with the owner ``note`` and ``close_lease``; the grant is then held as after
    an acquire. False, holding nothing, when the server refused it."""
    core = holding.core
    holding.forked()
    async with holding.op_lock:
        router = core.router
        if router is not None and not core.routing.route():
            await _refresh_map(holding, router)
            core.routing.route()
        conn = await holding.checkout()
        try:
            command, data, timeout = core.take_over_request(conn.server, token, note, close_lease)
            sent = time.monotonic()
            reply = await conn.request(command, data, timeout)
            held = core.on_take_over_reply(token, reply, sent, conn.server, conn.session)
        except BaseException:
            core.reset()
            await holding.checkin(conn)
            raise
        if not held:
            await holding.checkin(conn)
            return False
        await holding.start_renewing(conn)
        return True


# ---------------------------------------------------------------------- by token
async def release_token(holding: AsyncHolding, token: str) -> bool:
    """Release ``token`` on this key, granted to another object or process (one that died,
    say): one request by token, routed as an acquire is; True if the server released it,
    False if it no longer held it. This object's own state is untouched."""
    core = holding.core
    key, limit = core.key, core.limit
    _, reply = await request_by_token(
        holding, lambda _: _by_token.release_request(key, token, limit)
    )
    return _by_token.released(reply)


async def request_by_token(holding: AsyncHolding, build: Build) -> tuple[Command, Reply]:
    """One request about a grant this object does not hold (a release, renew, detach or
    note by token), routed as an acquire is: the command sent and its reply."""
    holding.forked()
    async with holding.op_lock:
        core = holding.core
        router = core.router
        if router is not None and not core.routing.route():  # cluster: the key's node now
            await _refresh_map(holding, router)
            core.routing.route()
        return await request_once(holding.checkout, holding.checkin, core.endpoint, build)


async def by_token(holding: AsyncHolding, build: Build) -> bool:
    """`_request_by_token`, read: True done, False when the token no longer holds the
    key; raises for other refusals."""
    command, reply = await request_by_token(holding, build)
    return _by_token.done(command, reply, holding.core.key, holding.core.endpoint)


async def renew_token(holding: AsyncHolding, token: str, lease_ttl: int) -> bool:
    """Renew ``token`` on this key (granted to any object or process) to ``lease_ttl``
    seconds from now; True if renewed, False if it no longer holds the key."""
    key = holding.core.key
    return await by_token(holding, lambda _: _by_token.renew_request(key, token, lease_ttl))


async def detach_token(holding: AsyncHolding, token: str, lease_ttl: int) -> bool:
    """Detach ``token``'s grant on this key from the connection it is bound to (``hd``),
    with a lease of ``lease_ttl`` seconds from now; True if done, False if it no longer
    holds the key. `HoldsUnsupported` for a server without holds."""
    core = holding.core
    return await by_token(
        holding,
        lambda server: _by_token.detach_request(
            server, core.endpoint.address, core.key, token, lease_ttl
        ),
    )


async def note_token(holding: AsyncHolding, token: str, note: str) -> bool:
    """Replace the owner note of ``token``'s grant on this key; True if done, False if
    it no longer holds the key. `HoldsUnsupported` for a server without holds."""
    core = holding.core
    return await by_token(
        holding,
        lambda server: _by_token.note_request(server, core.endpoint.address, core.key, token, note),
    )
