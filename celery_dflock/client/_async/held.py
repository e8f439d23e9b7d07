"""A lock object's holding: its connections, the grant it keeps alive (renewal, reattaching),
reporting a loss, the requests that let go (asyncio source of the ``_sync/`` twin; what each face
does its own way is in `celery_dflock.client._aio_backend` / `celery_dflock.client._sync_backend`).
What a user sees of it: [the client](../client.md#the-locks-on-their-own).

A held lock pins its connection, whose close frees a plain connection's locks (a session
connection's after its session time; a client session's end, not a close, ends its grants). When it
closes or breaks, the lock reattaches: it renews by token on a new connection to the same server
while the lease it last confirmed runs. An interrupted request closes its connection (never reused
out of step); an interrupted release closes the pinned connection, so the server frees the lock
rather than keep it unrenewed, and a grant a client session keeps (which that close does not end)
is released by token in the background."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable

from celery_dflock.client._aio_backend import (
    AsyncRenewalDriver,
    Background,
    Event,
    OpLock,
    background,
    call_back,
    pause,
)
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._async.keepalive import start_keeping
from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._async.routing import Build
from celery_dflock.client._core import LockCore
from celery_dflock.client._grant import LockState, RenewOutcome, closed_while_idle, redact
from celery_dflock.client._replies import Granted, Ok, Reply
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._session import Sessions
from celery_dflock.client._settings import Endpoint
from celery_dflock.client.errors import AuthError, DflockError, InvalidValueError

logger = logging.getLogger("celery_dflock.client")


def unreached(doing: str, core: LockCore, broken: str | None, then: str = "") -> None:
    """Log that ``doing`` ``core``'s grant found its server unreachable until the lease's end."""
    logger.warning(
        "%s dflock %s: the lock server at %s could not be reached before the lease ran out (%s)%s",
        doing,
        core.what,
        core.endpoint.address,
        redact(broken or "unreachable"),
        then,
    )


class AsyncHolding:
    """What a lock object holds and how it keeps it, around its `LockCore`."""

    __slots__ = (
        "_lost_event", "_lost_event_guard", "_on_lost", "_pool", "_releasing", "_server",
        "_server_at", "_sessions", "_waiting", "conn", "core", "driver", "op_lock",
    )  # fmt: skip

    def __init__(
        self, core: LockCore, on_lost: Callable[[], object] | None, pool: AsyncConnectionPool | None
    ) -> None:
        self.core = core
        if pool is not None and not isinstance(pool, AsyncConnectionPool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise InvalidValueError(
                f"pool must be a celery_dflock.{AsyncConnectionPool.__name__}, got "
                f"{type(pool).__name__} (the blocking and the asyncio locks each take a pool "
                "of their own kind)"
            )
        self._on_lost = on_lost  # the lock's on_lost, bound to the lock object
        self._pool = pool
        self._server: ServerInfo | None = None  # without a pool: asked once per lock object
        self._server_at: Endpoint | None = None  # the endpoint `_server` describes
        self.conn: AsyncConnection | None = None  # a grant's (or queue position's)
        self.op_lock = OpLock()  # renew / release / acquire never interleave
        self.driver = AsyncRenewalDriver(self, pool)
        self._lost_event: Event | None = None  # made on first use (see lost_event)
        self._lost_event_guard = threading.Lock()
        self._releasing: Background | None = None  # a release the server was not there for
        self._sessions: Sessions | None = None  # without a pool: its client sessions
        self._waiting = False  # an acquire that may wait is in flight (see `holds`)

    @property
    def lost_event(self) -> Event:
        event = self._lost_event
        if event is None:  # made on first use: most locks are never lost or waited on
            with self._lost_event_guard:
                event = self._lost_event
                if event is None:
                    event = self._lost_event = Event()
        return event

    @property
    def lost(self) -> bool:
        """The core's loss, once reported (`lost_event` set)."""
        event = self._lost_event
        return self.core.lost and event is not None and event.is_set()

    def forked(self) -> bool:
        """In a fork child of the holder: forget the lock (closing our copy of its socket), True."""
        if not self.core.grant.foreign_process():
            return False
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        self.op_lock = OpLock()
        self.driver.forget()
        logger.debug("%s was acquired by the parent process; the child ignores it", self.core.what)
        self.core.reset()
        return True

    async def checkout(self, endpoint: Endpoint | None = None) -> AsyncConnection:
        endpoint = self.core.endpoint if endpoint is None else endpoint
        if self._pool is not None:
            return await self._pool.checkout(endpoint)
        known = self._server if self._server_at == endpoint else None
        if self._sessions is None:
            self._sessions = Sessions()
        conn = await AsyncConnection.connect(endpoint, known, self._sessions)
        self._server, self._server_at = conn.server, endpoint
        return conn

    def server(self) -> ServerInfo | None:
        """What the held grant's server answered to ``hello``: on its connection, else as last
        heard (by the pool, or this lock), the connection broken."""
        if self.conn is not None:
            return self.conn.server
        endpoint = self.core.reattach_endpoint()
        if self._pool is not None:
            return self._pool.server_info(endpoint.host, endpoint.port)
        return self._server if self._server_at == endpoint else None

    def retire_session(self) -> None:
        """An acquire interrupted before the lock took a grant the server may have sent: the
        session it may be in is joined by no new connection (`ClientSession.retire`)."""
        sessions = self._sessions if self._pool is None else self._pool.sessions
        if sessions is not None:
            sessions.retire(self.core.endpoint)

    def poke(self) -> None:
        """The grant's client session is over: renew now to learn whether it is lost."""
        self.driver.poke()

    def holds(self) -> bool:
        """Whether its session is to be kept alive: it holds a grant, or waits for one."""
        core = self.core
        state = core.state
        held = state is LockState.HELD and not core.lost
        return held or state is LockState.ENQUEUED or self._waiting

    def keep_while_waiting(self, conn: AsyncConnection, waiting: bool) -> None:
        """An acquire that may wait is in flight on ``conn`` (``waiting``) or answered."""
        self._waiting = waiting
        if waiting:
            try:
                self._kept_by(conn)
            except RuntimeError as exc:  # no thread: asked again by `start_renewing`
                logger.debug("no keep-alive for %s while it waits: %s", self.core.what, exc)

    def _kept_by(self, conn: AsyncConnection) -> None:
        """A grant is held or waited for on ``conn``: keep its client session alive."""
        session = conn.session
        if session is not None:
            endpoint, pool = conn.endpoint, self._pool
            session.hold(
                self,
                lambda: start_keeping(
                    session, endpoint, self.checkout if pool is None else pool.checkout
                ),
            )

    async def checkin(self, conn: AsyncConnection) -> None:
        if self._pool is not None:
            await self._pool.checkin(conn)
        else:
            await conn.aclose()

    async def start_renewing(self, conn: AsyncConnection) -> bool:
        """After a grant (operation lock held): pin ``conn``, renew, watch it; True. A renewal
        that cannot start releases the grant rather than leave it unrenewed. A grant made on a
        connection whose client session ended while it waited (the server stalled past the
        session's time) is confirmed first: the connection joins the current session and the
        grant is renewed by token; False (the lock reset) when the server no longer holds it."""
        self.conn = conn
        if conn.session is not None and not conn.session.live() and not await self._confirm(conn):
            self.conn = None
            return await self.let_go(conn)
        event = self._lost_event
        if event is not None:
            event.clear()
        core = self.core
        try:
            self.driver.start(
                conn, core.renew_interval(), core.first_renewal_in(), f"dflock-renew:{core.key}"
            )
            self._kept_by(conn)
        except Exception as exc:
            exc.add_note(
                f"dflock: the renewal of {core.what} could not be started, so its grant was "
                "released (a process at its thread or pid limit?)"
            )
            try:
                await self.release_locked()
            except Exception:  # the first exception is the one raised
                logger.debug("releasing %s after a failed start failed", core.what, exc_info=True)
            core.reset()
            raise
        return True

    async def _confirm(self, conn: AsyncConnection) -> bool:
        """`start_renewing`'s confirmation of a grant made in a session that ended (``conn``
        pinned: an interruption abandons the grant, released by token in the background, as is
        one whose renewal got no answer: the live session it joined would keep it)."""
        try:
            await conn.rejoin()
            self.core.grant.session = conn.session  # where the server has it now, if anywhere
            outcome = await self._renew_request(conn)
        except DflockError:  # the request closed it: the grant ends with its old session
            return False
        except BaseException:
            self.abandon()
            raise
        if outcome.reattach and not outcome.renewed:
            self.abandon()
        return outcome.renewed

    async def renew_guarded(self, scheduled: bool) -> bool | None:
        """`renew_once`; an unexpected error marks the lock lost instead of escaping."""
        try:
            return await self.renew_once(scheduled)
        except Exception as exc:
            logger.exception("unexpected error renewing dflock %s", self.core.what)
            async with self.op_lock:
                first = self.core.mark_lost(f"unexpected error while renewing: {exc!r}")
            if first:
                await self.notify_lost()
            return False

    async def renew_once(self, scheduled: bool) -> bool | None:
        """One renewal: True renewed, False lost, None nothing to renew (``scheduled``: the
        background's, a no-op once release began). A broken connection is reattached."""
        core = self.core
        async with self.op_lock:
            conn = self.conn
            if (scheduled and self.driver.cancelled) or core.state is not LockState.HELD:
                return None
            if core.lost:
                return False
            first: bool | None = None  # None: reattach
            ended = core.grant.session_ended()
            if ended is not None:
                first = core.mark_lost(ended)
            elif conn is not None and (seen := conn.idle_breakage()) is not None:
                self._drop_connection(conn, closed_while_idle(seen))
            elif conn is not None and scheduled and core.grant.kept_alive():
                return True  # its session's keep-alives renew it: no request of its own
            elif conn is not None:
                outcome = await self._renew_request(conn)
                if outcome.renewed:
                    self.driver.renewed(conn)
                    return True
                if not outcome.reattach:
                    first = core.mark_lost(outcome.lost_reason or "renewal refused")
        if first is None:
            return await self._reattach(scheduled)
        if first:
            await self.notify_lost()
        return False

    def _drop_connection(self, conn: AsyncConnection, detail: str) -> None:
        """The held connection broke: close it, stop watching it, the next renewal reattaches."""
        if self.conn is conn:
            self.conn = None
            self.driver.unwatch(conn)
        conn.close()
        self.core.connection_broke(detail)

    async def let_go(self, conn: AsyncConnection | None) -> bool:
        """Forget the grant without a request, ``conn`` back to the pool: False."""
        self.core.reset()
        if conn is not None:
            await self.checkin(conn)
        return False

    async def _renew_request(self, conn: AsyncConnection) -> RenewOutcome:
        """One renewal by token on ``conn``; a connection that breaks or drains is dropped."""
        command, data, timeout = self.core.renew_request()
        sent = time.monotonic()
        try:
            reply = await conn.request(command, data, timeout)
        except DflockError as exc:
            self._drop_connection(conn, str(exc))  # the request closed it
            return RenewOutcome(renewed=False, lost_reason=str(exc), reattach=True)
        outcome = self.core.on_renew_reply(reply, sent, conn.session)
        if outcome.renewed and conn.session is None and self.core.grant.session is not None:
            self.core.grant.left_session(conn.server, sent)  # a server restarted without them
        if outcome.reattach:
            self._drop_connection(conn, outcome.lost_reason or "the server is shutting down")
        return outcome

    async def _reattach(self, scheduled: bool) -> bool | None:
        """Reconnect and renew by token, pausing between tries outside the operation lock: True once
        renewed, False (lost) if refused or the lease ends first, None once release began."""
        core = self.core
        while True:
            wait_s: float | None = None
            async with self.op_lock:
                if (scheduled and self.driver.cancelled) or core.state is not LockState.HELD:
                    return None
                if core.lost:
                    return False
                if self.conn is not None:
                    return True  # reattached meanwhile (by `renew`)
                ended = core.grant.session_ended()
                if ended is not None:
                    first = core.mark_lost(ended)
                elif core.grant.reattach_left() <= 0:
                    first = core.mark_unreachable()
                else:
                    outcome = await self._reattach_once()
                    if outcome.renewed:
                        return True
                    if outcome.reattach:
                        wait_s = core.grant.reattach_pause(outcome.lost_reason or "unreachable")
                        first = core.mark_unreachable() if wait_s is None else False
                    else:
                        first = core.mark_lost(outcome.lost_reason or "renewal refused")
            if wait_s is not None:
                await pause(wait_s)
                continue
            if first:
                await self.notify_lost()
            return False

    async def _reattach_once(self) -> RenewOutcome:
        try:
            conn = await self.checkout(self.core.reattach_endpoint())
        except AuthError as exc:  # no later attempt does better: lost now
            reason = f"the lock server refused this client's auth when it reconnected ({exc})"
            return RenewOutcome(renewed=False, lost_reason=reason, reattach=False)
        except DflockError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                self.core.grant.refused()  # the server is not running: frees nothing meanwhile
            return RenewOutcome(renewed=False, lost_reason=str(exc), reattach=True)
        try:
            outcome = await self._renew_request(conn)
        except BaseException:
            conn.close()
            raise
        if outcome.renewed:
            self.conn = conn
            self.driver.attach(conn)
            self.driver.renewed(conn)
            self._kept_by(conn)
        elif not outcome.reattach:
            await self.checkin(conn)  # refused: the connection itself is fine
        return outcome

    async def request_held(
        self,
        conn: AsyncConnection | None,
        build: Build,
        *,
        core: LockCore | None = None,
        once: bool = False,
    ) -> tuple[Reply, AsyncConnection, bool] | None:
        """Send ``build``'s request about the held grant (renewal stopped) on ``conn`` (unless
        it broke while idle: closed), or on new connections while the lease runs. Returns the
        reply, its connection, and whether an earlier attempt may have reached the server; None
        when the lease ran out unanswered, or (``once``) the first attempt on a new connection
        was. ``core``: a background release's copy."""
        core = self.core if core is None else core
        if conn is not None and (seen := conn.idle_breakage()) is not None:
            # (given ``conn``: ours, not a copy's)
            self._drop_connection(conn, closed_while_idle(seen))
            conn = None
        retried = False
        fresh = conn is None
        while True:
            detail = "unreachable"
            if conn is None:
                try:
                    conn = await self.checkout(core.reattach_endpoint())
                except DflockError as exc:
                    if isinstance(exc.__cause__, ConnectionRefusedError):
                        core.grant.refused()  # the server is not running: frees nothing meanwhile
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
            wait_s = core.grant.reattach_pause(detail)
            if wait_s is None or (once and fresh):
                return None
            fresh = True
            await pause(wait_s)

    async def notify_lost(self) -> None:
        """Report a loss: `lost_event` (and with it `lost`), then ``on_lost``."""
        self.lost_event.set()
        if self._on_lost is not None:
            try:
                await call_back(self._on_lost)
            except Exception:
                logger.exception("the on_lost callback of dflock %s raised", self.core.what)

    def abandon(self) -> None:
        """Interrupted release: close the pinned connection (the server frees the lock); a
        grant a client session keeps is released by token in the background."""
        conn, self.conn = self.conn, None
        if conn is not None:
            self.driver.unwatch(conn)
            conn.close()
        core = self.core
        if core.state is LockState.HELD and not core.lost and core.grant.session is not None:
            self._release_later()
        else:
            core.reset()

    async def release_locked(self) -> bool:
        """Release, renewal stopped (operation lock held): leave a queue, or release the grant.
        True if the server released it."""
        conn, self.conn = self.conn, None
        self.driver.unwatch(conn)
        core = self.core
        state = core.state
        if state is LockState.IDLE:
            return False
        if state is LockState.ENQUEUED:
            return await self._leave_queue(conn)
        if core.lost:
            return await self.let_go(conn)
        try:
            sent = await self.request_held(conn, lambda _: core.release_request(), once=True)
        except BaseException:
            self.abandon()  # the request closed the connection; a session may keep the grant
            raise
        if sent is None:
            self._release_later()
            return False
        reply, conn, retried = sent
        released = core.on_release_reply(reply, retried=retried)  # refused: marked lost
        await self.checkin(conn)
        return released

    async def _leave_queue(self, conn: AsyncConnection | None) -> bool:
        """Release an enqueued lock: a grant that came meanwhile is collected (``w 0``) and
        released, True, for it would outlive its connection's close by the session time; then
        the connection closes, which leaves the queue (there is no dequeue command)."""
        core = self.core
        assert conn is not None  # ENQUEUED: its connection is kept (`_grant_routed`)
        try:
            command, data, timeout = core.wait_request(0)
            sent = time.monotonic()
            reply = await conn.request(command, data, timeout)
            if not isinstance(reply, Granted):  # not granted: nothing to read into the lock
                return False
            core.on_grant_reply(command, reply, sent, conn.server, conn.session)  # held now
            command, data, timeout = core.release_request()
            return isinstance(await conn.request(command, data, timeout), Ok)
        except DflockError as exc:  # the connection broke, or a refusal: closing is all left
            logger.debug("leaving the queue of %s: %s", core.what, exc)
            return False
        finally:
            core.reset()
            await conn.aclose()

    def _release_later(self) -> None:
        """Unanswered release: the background releases a copy of the grant while the lease
        runs; the lock object resets at once."""
        core = self.core
        later = copy.copy(core)
        core.reset()
        logger.info(
            "releasing dflock %s: the lock server at %s did not answer (%s); releasing in the "
            "background while the lease runs (%.1f s left), the caller goes on",
            later.what,
            later.endpoint.address,
            redact(later.grant.broken or "unreachable"),
            max(0.0, later.grant.lease_left()),
        )
        try:
            self._releasing = background(
                lambda: self._release_in_background(later), f"dflock-release:{later.key}"
            )
        except RuntimeError as exc:  # no thread (a process at its pid limit): the lease frees it
            logger.warning(
                "releasing dflock %s: no thread to release it in the background (%s); the "
                "lease frees it",
                later.what,
                exc,
            )

    async def _release_in_background(self, core: LockCore) -> None:
        try:
            sent = await self.request_held(None, lambda _: core.release_request(), core=core)
        except Exception:
            logger.exception("unexpected error releasing dflock %s in the background", core.what)
            return
        if sent is None:
            unreached("releasing", core, core.grant.broken, "; the lease frees it")
            return
        reply, conn, _ = sent
        await conn.aclose()  # not pooled: the caller may have closed its pool meanwhile
        if core.on_release_reply(reply, retried=True):
            logger.info(
                "dflock %s: released in the background, the lock server at %s answering again",
                core.what,
                core.endpoint.address,
            )
