"""The lock and semaphore classes of one face: locks and semaphores with lease renewal in the
background, the dflockd client's parameters in its order.

Written once for both faces: the asyncio source, ``celery_dflock/client/_async/lock.py``
(`AsyncDistributedLock`, `AsyncDistributedSemaphore`), and the blocking twin that
``scripts/unasync.py`` generates from it in ``_sync/`` (`DistributedLock`,
`DistributedSemaphore`). What a lock does is shared by both kinds: acquiring (``acquiring.py``)
on top of holding (``held.py``), beside this module; the decisions are the I/O-free
`celery_dflock.client._core.LockCore`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from ssl import SSLContext
from typing import Self

from celery_dflock.client import protocol
from celery_dflock.client._async.acquiring import AsyncLockBase
from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._core import LockCore
from celery_dflock.client._grant import LockState, redact
from celery_dflock.client._router import ClusterRouter
from celery_dflock.client._servers import Hold
from celery_dflock.client._settings import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    ClientSettings,
    check_limit,
    lease_seconds,
)
from celery_dflock.client.errors import KeyHeld, LockNotAcquired
from celery_dflock.client.protocol import Renewed
from celery_dflock.client.sharding import Routing, stable_hash_shard

__all__ = ["AsyncDistributedLock", "AsyncDistributedSemaphore"]

logger = logging.getLogger("celery_dflock.client")


class AsyncDistributedLock(AsyncLockBase):
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
        lease_ttl_s: int | None = None,
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
        settings = ClientSettings.checked(
            servers,
            sharding_strategy,
            renew_ratio,
            auth_token,
            ssl_context,
            connect_timeout_s,
            acquire_timeout_s,
            lease_ttl_s,
        )
        core = LockCore(
            key,
            settings,
            acquire_timeout_s=settings.acquire_timeout_s,
            lease_ttl_s=settings.lease_ttl_s,
            router=router,
            note=note,
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
            None if on_close_lease is None else lease_seconds("on_close_lease", on_close_lease)
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
        lease = lease_seconds("lease_ttl", lease_ttl)
        if self._forked() or not self._core.locked():
            return False
        await self._driver.stop()
        async with self._op_lock:
            core = self._core
            conn, self._conn = self._conn, None
            self._driver.unwatch(conn)
            if core.state is not LockState.HELD or core.lost:
                return await self._let_go(conn)
            try:
                sent = await self._request_held(
                    self._unless_broken(conn), lambda server: core.hand_off_request(lease, server)
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
        )
        core = LockCore(
            key,
            settings,
            limit=check_limit(limit),
            acquire_timeout_s=settings.acquire_timeout_s,
            lease_ttl_s=settings.lease_ttl_s,
            router=router,
        )
        super().__init__(core, on_lost, pool)

    @property
    def limit(self) -> int:
        """The semaphore's number of slots."""
        assert self._core.limit is not None
        return self._core.limit
