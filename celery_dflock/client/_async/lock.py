"""The lock and semaphore classes of one face: locks and semaphores with lease renewal in the
background, the dflockd client's parameters in its order.

Written once for both faces: the asyncio source, ``celery_dflock/client/_async/lock.py``
(`AsyncDistributedLock`, `AsyncDistributedSemaphore`), and the blocking twin that
``scripts/unasync.py`` generates from it in ``_sync/`` (`DistributedLock`,
`DistributedSemaphore`). A lock object owns what it does, shared by both kinds: its holding
(``held.py``: its connections, the grant kept alive, loss, release) and its acquiring
(``acquiring.py``: getting a grant, requests by token), beside this module; the decisions are
the I/O-free `celery_dflock.client._core.LockCore`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from ssl import SSLContext
from types import TracebackType
from typing import Self

from celery_dflock.client._aio_backend import Event
from celery_dflock.client._async import acquiring
from celery_dflock.client._async.held import AsyncHolding
from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._core import EnqueueResult, LockCore
from celery_dflock.client._grant import LockState
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
)
from celery_dflock.client.errors import KeyHeld, LockNotAcquired
from celery_dflock.client.sharding import Routing, stable_hash_shard

__all__ = ["AsyncDistributedLock", "AsyncDistributedSemaphore", "AsyncLockBase"]


class AsyncLockBase:
    """What a lock and a semaphore of this face are and do (all but the commands of one kind):
    the public attributes and operations, each carried out by what the object owns, its
    holding (`AsyncHolding`, around one `LockCore`), on which its acquiring
    (`celery_dflock.client._async.acquiring`) gets grants."""

    def __init__(
        self,
        core: LockCore,
        on_lost: Callable[[Self], object] | None,
        pool: AsyncConnectionPool | None,
    ) -> None:
        self._setup(core, on_lost, pool)

    def _setup(
        self,
        core: LockCore,
        on_lost: Callable[[Self], object] | None,
        pool: AsyncConnectionPool | None,
    ) -> None:
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
        """A lock around ``core``, made on settings checked already (a client's)."""
        lock = cls.__new__(cls)
        lock._setup(core, on_lost, pool)
        return lock

    # ------------------------------------------------------------------ attributes
    @property
    def lost_event(self) -> Event:
        """Set when the held lock is lost (cleared by the next successful acquire)."""
        return self._holding.lost_event

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
        return self._holding.lost

    def locked(self) -> bool:
        """True while held by this object in this process (acquired, not released)."""
        return self._core.locked()

    def owned(self) -> bool:
        """`locked`, not `lost`, and the grant is known to be still held: the lease runs, and
        on a session connection the server answered recently enough (since the send time of
        its last answered request, less than its session time, less a margin). After a pause
        past that, False until a renewal is answered."""
        return self._core.owned()

    # ------------------------------------------------------------------ acquiring
    async def acquire(self) -> bool:
        """Take the lock, waiting up to ``acquire_timeout_s`` in FIFO order.

        True when granted (renewal starts), False on timeout. Raises `ServerUnavailable`,
        `AuthError`, `MaxLocksError`, ... when the server cannot or will not answer.
        Interrupting it closes the connection, which also takes it out of the server's queue.
        """
        return await acquiring.grant(self._holding, self._core.acquire_request)

    async def enqueue(self) -> EnqueueResult:
        """Two-phase step 1: join the queue without blocking.

        ``"acquired"`` if the lock was free and is now held, ``"queued"`` if queued (then call
        `wait`); an `EnqueueResult`, true only when acquired (``if lock.enqueue():`` works).
        `LockNotAcquired` when a cluster hand-over outlasted ``acquire_timeout_s`` (at least
        2 s): neither held nor queued.
        """
        return await acquiring.enqueue(self._holding)

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Two-phase step 2: wait up to ``timeout_s`` (default ``acquire_timeout_s``).

        True once held (also when `enqueue` already got it). False on timeout; the queue
        position is then given up (its connection is closed).
        """
        return await acquiring.wait(self._holding, timeout_s)

    # ------------------------------------------------------------------ holding
    async def renew(self) -> bool:
        """Renew the lease now (the background renewal does this on its own).

        True if renewed; False if the lock is lost (then `lost` is True, ``on_lost`` ran).
        Raises `LockNotOwned` when not held (also in a fork child of the holder).
        """
        return await self._holding.renew()

    async def release(self) -> bool:
        """Release the lock; True if the server confirmed it. Idempotent.

        Stops the renewal first (waiting for one in flight). When its connection broke, it
        reconnects to the lock's server once and releases by token there. When the server
        does not answer (down, restarting, draining), the release is handed to the background
        and this returns False at once (logged): the background goes on reconnecting and
        releasing by token while the lease runs, and the lease frees the key if the server
        stays away longer; the lock object is free to acquire again meanwhile (its next grant
        comes after the old one is released or has run out). False when nothing was held or
        the lock was lost. If the server no
        longer held the grant (its lease ran out unnoticed, e.g. while the process was paused,
        or it was freed with a closed connection), the lock was lost before this release: it
        is reported as lost (`lost`, `lost_event`, ``on_lost``) first. Leaves a queue after
        `enqueue`. In a fork child of the holder, does nothing (the parent's lock and socket
        are untouched).
        Interrupting it closes the connection, which makes the server release the lock.
        """
        return await self._holding.release()

    # ------------------------------------------------------------------ context manager
    async def __aenter__(self) -> Self:
        if not await acquiring.grant(self._holding, self._core.acquire_request):
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
        await self._holding.release()

    # ------------------------------------------------------------------ by token
    async def release_token(self, token: str) -> bool:
        """Release ``token`` on this key, granted to another object or process (one that died,
        say): one request by token, routed as an acquire is; True if the server released it,
        False if it no longer held it. This object's own state is untouched."""
        return await acquiring.release_token(self._holding, token)

    async def renew_token(self, token: str, lease_ttl: int) -> bool:
        """Renew ``token`` on this key (granted to any object or process) to ``lease_ttl``
        seconds from now; True if renewed, False if it no longer holds the key."""
        return await acquiring.renew_token(self._holding, token, lease_ttl)

    async def detach_token(self, token: str, lease_ttl: int) -> bool:
        """Detach ``token``'s grant on this key from the connection it is bound to (``hd``),
        with a lease of ``lease_ttl`` seconds from now; True if done, False if it no longer
        holds the key. `HoldsUnsupported` for a server without holds."""
        return await acquiring.detach_token(self._holding, token, lease_ttl)

    async def note_token(self, token: str, note: str) -> bool:
        """Replace the owner note of ``token``'s grant on this key; True if done, False if
        it no longer holds the key. `HoldsUnsupported` for a server without holds."""
        return await acquiring.note_token(self._holding, token, note)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.describe()})"


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
            if not await acquiring.grant(
                self._holding,
                lambda server: core.hold_request(server, note, detached=detached),
                keep=False,
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
        return await acquiring.take_over(self._holding, token, ht_note, close_lease)

    async def hand_off(self, lease_ttl: int) -> bool:
        """Let go of the held grant without releasing it (``hd``): the server detaches it from
        this object's connection with a lease of ``lease_ttl`` seconds from now; this object
        stops renewing and forgets its token (a later `release` is a no-op returning False,
        and not a loss). True when the server did. The grant is then a hold any process can
        `adopt` or release by its token. (A server without holds: a last renewal to
        ``lease_ttl``, the grant stays bound to the connection, back in the pool.) When the
        held connection broke, it reconnects and hands off by token, as `release` does."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        return await self._holding.hand_off(lease)


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
