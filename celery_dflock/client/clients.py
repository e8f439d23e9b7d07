"""`Client` and `AsyncClient`: the one public entry to the lock servers.

A client holds what every lock shares, once and validated once (`ClientSettings`): the servers
and how keys are sharded over them, the auth token, TLS, the connect timeout, the renew ratio
and the default acquire timeout and lease; and it owns the connection pool its locks use::

    with Client([("127.0.0.1", 6388)], auth_token=secret) as client:
        with client.lock("report:42", acquire_timeout_s=5) as lock:
            write(data, fence=lock.fence)
        client.release("report:43", token_of_a_dead_worker)   # release by token
        for status in client.stats():                          # what each server holds
            print(status.address, status.stats)

Locks are the public `DistributedLock` / `DistributedSemaphore` (and their async twins), built
on the client's settings (passed down whole, not checked again) and pool; a release, renewal,
detach or note by token is one request on a pooled connection to the key's server, made
without a lock object. The Celery layer (tasks, beat, ``celery dflock``)
reaches the servers only through a client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from ssl import SSLContext
from typing import Any, Final, Generic, Self, TypeVar, cast

from celery_dflock.client import _by_token, _requests, wire
from celery_dflock.client._async.lock import AsyncDistributedLock, AsyncDistributedSemaphore
from celery_dflock.client._async.routing import (
    send_by_token as send_by_token_async,
    send_to_owner as send_to_owner_async,
)
from celery_dflock.client._async.status import ask as ask_async, ask_shards as ask_shards_async
from celery_dflock.client._core import LockCore
from celery_dflock.client._router import ClusterRouter, split_address
from celery_dflock.client._servers import (
    FEATURE_FENCE,
    FEATURE_HOLDS,
    FEATURE_PING,
    FEATURE_STATS,
    Hold,
    ServerInfo,
)
from celery_dflock.client._settings import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    DEFAULT_SESSION_TTL_S,
    ClientSettings,
    Endpoint,
    Lease,
    check_auth_token,
    check_limit,
    check_renew_ratio,
    check_servers,
    lease_seconds,
    positive_seconds,
    whole_seconds,
)
from celery_dflock.client._status import ServerShards, ServerStatus
from celery_dflock.client._sync.lock import DistributedLock, DistributedSemaphore
from celery_dflock.client._sync.routing import BuildAt, send_by_token, send_to_owner
from celery_dflock.client._sync.status import ask, ask_shards
from celery_dflock.client._threads import leave_signals_to_the_main_thread
from celery_dflock.client.errors import InvalidValueError
from celery_dflock.client.pool import AsyncConnectionPool, ConnectionPool
from celery_dflock.client.sharding import CLUSTER, Routing, select_server, stable_hash_shard

# The client layer's public face for integrations (the Celery layer uses nothing else): the
# clients, the defaults and validators (used with its own setting names), what a server said.
__all__ = [
    "DEFAULT_ACQUIRE_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_RENEW_RATIO",
    "DEFAULT_SERVERS",
    "DEFAULT_SESSION_TTL_S",
    "FEATURE_FENCE",
    "FEATURE_HELLO",
    "FEATURE_HOLDS",
    "FEATURE_PING",
    "FEATURE_STATS",
    "AsyncClient",
    "Client",
    "ClientSettings",
    "Hold",
    "Lease",
    "ServerInfo",
    "ServerShards",
    "ServerStatus",
    "check_auth_token",
    "check_limit",
    "check_renew_ratio",
    "check_servers",
    "lease_seconds",
    "leave_signals_to_the_main_thread",
    "positive_seconds",
]

FEATURE_HELLO: Final = wire.FEATURE_HELLO


# ------------------------------------------------------------------------------ the clients


L = TypeVar("L", DistributedLock, AsyncDistributedLock)
S = TypeVar("S", DistributedSemaphore, AsyncDistributedSemaphore)
P = TypeVar("P", ConnectionPool, AsyncConnectionPool)


class _ClientBase(Generic[L, S, P]):
    """The settings both clients hold, and the locks they make with them (each client names
    its lock classes and pool)."""

    _settings: ClientSettings
    _lock_class: type[L]
    _semaphore_class: type[S]
    _pool_class: type[P]

    def __init__(
        self,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        *,
        sharding_strategy: Routing = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        auth_token: str | None = None,
        ssl_context: SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: int | None = None,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    ) -> None:
        self._setup(
            ClientSettings.checked(
                servers,
                sharding_strategy=sharding_strategy,
                renew_ratio=renew_ratio,
                auth_token=auth_token,
                ssl_context=ssl_context,
                connect_timeout_s=connect_timeout_s,
                acquire_timeout_s=acquire_timeout_s,
                lease_ttl_s=lease_ttl_s,
                session_ttl_s=session_ttl_s,
            )
        )

    @classmethod
    def from_settings(cls, settings: ClientSettings) -> Self:
        """A client on ``settings`` validated already (by the Celery layer, whose errors name
        its ``dflock_*`` settings)."""
        client = cls.__new__(cls)
        client._setup(settings)
        return client

    def _setup(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._pool: P = self._pool_class()
        self._router = (
            ClusterRouter(settings.servers) if settings.sharding_strategy == CLUSTER else None
        )
        """Cluster routing: the one cached map of this client's locks."""

    @property
    def pool(self) -> P:
        """The connections of every lock this client makes."""
        return self._pool

    def lock(
        self,
        key: str,
        *,
        acquire_timeout_s: float | None = None,
        lease_ttl_s: int | None = None,
        on_lost: Callable[[L], object] | None = None,
        note: str | None = None,
    ) -> L:
        """An unacquired lock on ``key`` (a `DistributedLock`, or `AsyncDistributedLock`
        from an `AsyncClient`); None: the client's default. ``note``: the owner note each
        acquire gives a server with holds (``stats`` shows it; a refused `KeyHeld` or
        ``lock.holder`` names it); a foreign server ignores it."""
        return self._lock(
            key, self._acquire_timeout(acquire_timeout_s), self._lease(lease_ttl_s), on_lost, note
        )

    def _lock(
        self,
        key: str,
        acquire_timeout_s: int,
        lease_ttl_s: int | None,
        on_lost: Callable[[L], object] | None = None,
        note: str | None = None,
    ) -> L:
        """`lock`, its timeout and lease checked already."""
        core = LockCore(
            key,
            self._settings,
            acquire_timeout_s=acquire_timeout_s,
            lease_ttl_s=lease_ttl_s,
            router=self._router,
            note=note,
        )
        make: Any = self._lock_class
        return cast("L", make._of(core, on_lost, self._pool))

    def _for_hold(self, key: str, lease_ttl: int, timeout: float) -> L:
        """The lock that takes a hold (every argument checked, naming it; the note where the
        hold's request is made, ``LockCore.hold_request``)."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        wait = whole_seconds("timeout", timeout, minimum=0)
        return self._lock(key, wait, lease)

    def semaphore(
        self,
        key: str,
        limit: int,
        *,
        acquire_timeout_s: float | None = None,
        lease_ttl_s: int | None = None,
        on_lost: Callable[[S], object] | None = None,
    ) -> S:
        """An unacquired semaphore of ``limit`` slots on ``key`` (a `DistributedSemaphore`,
        or `AsyncDistributedSemaphore` from an `AsyncClient`)."""
        core = LockCore(
            key,
            self._settings,
            limit=check_limit(limit),
            acquire_timeout_s=self._acquire_timeout(acquire_timeout_s),
            lease_ttl_s=self._lease(lease_ttl_s),
            router=self._router,
        )
        make: Any = self._semaphore_class
        return cast("S", make._of(core, on_lost, self._pool))

    @property
    def settings(self) -> ClientSettings:
        """What every lock of this client shares."""
        return self._settings

    @property
    def servers(self) -> tuple[tuple[str, int], ...]:
        """The ``(host, port)`` of every server, in the order keys are sharded over."""
        return self._settings.servers

    @property
    def router(self) -> ClusterRouter | None:
        """Cluster routing (``sharding_strategy="cluster"``): the cached map its locks share
        (``router.map``: None until a lock fetched it); None otherwise."""
        return self._router

    def server_for(self, key: str) -> tuple[str, int]:
        """The ``(host, port)`` that owns ``key`` (no I/O; in cluster mode by the cached map,
        the first seed while there is none)."""
        settings = self._settings
        strategy = settings.sharding_strategy
        if strategy == CLUSTER or isinstance(strategy, str):
            owner = None if self._router is None else self._router.owner(key)
            return settings.servers[0] if owner is None else owner
        return settings.servers[select_server(key, settings.servers, strategy)]

    def _acquire_timeout(self, acquire_timeout_s: float | None) -> int:
        """A lock's acquire timeout: its own (checked here), else the client's."""
        if acquire_timeout_s is None:
            return self._settings.acquire_timeout_s
        return whole_seconds("acquire_timeout_s", acquire_timeout_s, minimum=0)

    def _lease(self, lease_ttl_s: int | None) -> int | None:
        """A lock's lease: its own (checked here), else the client's."""
        if lease_ttl_s is None:
            return self._settings.lease_ttl_s
        return lease_seconds("lease_ttl_s", lease_ttl_s)

    def _members(self, answers: Sequence[ServerShards]) -> list[Endpoint]:
        """The seeds, then every member the seeds' ``shards`` answers name: in cluster mode
        ``stats`` and ``ping`` of every server ask every member, not only the seeds."""
        found = list(self._settings.servers)
        for answer in answers:
            info = answer.shards
            if info is None:
                continue
            named = [*info.members, *(info.cluster.nodes if info.cluster is not None else ())]
            for name in named:
                address = split_address(name)
                if address not in found:
                    found.append(address)
        return [self._settings.endpoint(*address) for address in found]

    def _endpoints(self, server: tuple[str, int] | str | None) -> list[Endpoint]:
        if server is None:
            return self._settings.endpoints()
        if isinstance(server, str):
            host, _, port = server.rpartition(":")
            server = (host.strip("[]"), int(port)) if port.isdigit() else (server, -1)
        if server not in self._settings.servers:
            known = ", ".join(f"{host}:{port}" for host, port in self._settings.servers)
            raise InvalidValueError(f"{server!r} is not one of this client's servers ({known})")
        return [self._settings.endpoint(*server)]

    def __repr__(self) -> str:
        servers = ",".join(f"{host}:{port}" for host, port in self._settings.servers)
        return f"{type(self).__name__}({servers})"


class Client(_ClientBase[DistributedLock, DistributedSemaphore, ConnectionPool]):
    """Blocking locks, semaphores, release by token, stats and ping, over one
    `ConnectionPool`; thread safe; the pool is fork safe (a child opens its own connections).

    Arguments as `DistributedLock`'s, held once: ``servers``, ``sharding_strategy``,
    ``renew_ratio``, ``auth_token``, ``ssl_context``, ``connect_timeout_s``, and the defaults
    of every lock it makes, ``acquire_timeout_s`` and ``lease_ttl_s`` (None: the server's).
    """

    _lock_class = DistributedLock
    _semaphore_class = DistributedSemaphore
    _pool_class = ConnectionPool

    def release(self, key: str, token: str, *, limit: int | None = None) -> bool:
        """Release ``token`` on ``key`` (``limit``: a semaphore's slot), granted to any process:
        True if the server released it, False if it no longer held it. Idempotent."""
        request = _by_token.release_request(_requests.validate_key(key), token, limit)
        _, reply, _ = send_by_token(
            self._pool, self._settings, self._router, key, lambda _, __: request
        )
        return _by_token.released(reply)

    def hold(
        self, key: str, *, note: str, lease_ttl: int, timeout: float = 0.0, detached: bool = True
    ) -> Hold:
        """Take a detached hold of the lock ``key`` (``hl ... d``), routed as `lock` is: it
        survives this process and its connection, and ends only when its token is released
        (`release`, from any process) or its lease of ``lease_ttl`` seconds runs out (`renew`
        extends it; ``lock.adopt(token, note=...)`` takes it over, one run at a time).
        ``note`` (1 to 200 printable ASCII characters without spaces) names the owner. Waits
        up to ``timeout`` seconds for a busy key (0: try once). Raises `KeyHeld`
        (``.holder``: the holder's note) when the key stays busy, `HoldsUnsupported` for a
        server without holds (a foreign dflockd), and
        `InvalidValueError` naming a malformed ``note``.

        ``detached=False``: the grant stays bound to the pooled connection that took it (a
        closed connection frees it) until `detach` detaches it: a publish-time hold that is
        confirmed only once its message is sent."""
        return self._for_hold(key, lease_ttl, timeout).hold(note, detached=detached)

    def detach(self, key: str, token: str, *, lease_ttl: int) -> bool:
        """Detach ``token``'s grant on ``key`` from its connection (``hd``), with a lease of
        ``lease_ttl`` seconds from now: True, or False if it no longer holds the key."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        key, token = _requests.validate_key(key), _requests.validate_token(token)
        return self._done(
            key, lambda server, where: _by_token.detach_request(server, where, key, token, lease)
        )

    def renew(self, key: str, token: str, *, lease_ttl: int) -> bool:
        """Renew ``token`` on ``key`` (a hold, or any grant) to ``lease_ttl`` seconds from
        now: True, or False if it no longer holds the key."""
        request = _by_token.renew_request(
            _requests.validate_key(key), token, lease_seconds("lease_ttl", lease_ttl)
        )
        return self._done(key, lambda _, __: request)

    def note(self, key: str, token: str, note: str) -> bool:
        """Replace the owner note of ``token``'s grant on ``key``: True, or False if it no
        longer holds the key; `HoldsUnsupported` for a server without holds."""
        key, note = _requests.validate_key(key), _requests.validate_note(note)
        return self._done(
            key, lambda server, where: _by_token.note_request(server, where, key, token, note)
        )

    def force_release(self, key: str, *, note: str | None = None) -> int:
        """Free ``key`` whoever holds it (an operator's act, ``fr``): every grant on it ends
        now, the next waiter is granted at once (with a higher fence), and the old holder
        learns its loss at its next renewal. ``note`` (an owner note's rules: 1 to 200
        printable ASCII characters without spaces) names who asks in the server's log.
        Returns how many grants were freed (0: nothing held the key). Raises
        `ForceReleaseUnsupported` for a server that predates it, `InvalidValueError` for a
        bad key or note."""
        key = _requests.validate_key(key)
        if note is not None:
            _requests.validate_note(note, "the operator's note")
        command, reply, at = send_to_owner(
            self._pool,
            self._settings,
            self._router,
            key,
            lambda server, where: _by_token.force_release_request(server, where, key, note),
        )
        return _by_token.freed(command, reply, key, at)

    def _done(self, key: str, build: BuildAt) -> bool:
        """One request by token about ``key``: True done, False when the token no longer holds
        the key; raises for other refusals."""
        command, reply, at = send_by_token(self._pool, self._settings, self._router, key, build)
        return _by_token.done(command, reply, key, at)

    def stats(self, server: tuple[str, int] | str | None = None) -> list[ServerStatus]:
        """Every server's (or ``server``'s) ``stats``: never raises for an unreachable one. In
        cluster mode every server is every member of the cluster, not only the seeds."""
        return [ask(endpoint, True) for endpoint in self._everyone(server)]

    def ping(self, server: tuple[str, int] | str | None = None) -> list[ServerStatus]:
        """Whether every server (or ``server``) answers; an unreachable one has ``error``."""
        return [ask(endpoint, False) for endpoint in self._everyone(server)]

    def _everyone(self, server: tuple[str, int] | str | None) -> list[Endpoint]:
        if server is None and self._router is not None:
            return self._members(self.shards())
        return self._endpoints(server)

    def shards(self, server: tuple[str, int] | str | None = None) -> list[ServerShards]:
        """What every server (or ``server``) answers to ``shards``: its mode, members, and in
        cluster mode the shard map; never raises for an unreachable one."""
        return [ask_shards(endpoint) for endpoint in self._endpoints(server)]

    def close(self) -> None:
        """Close the idle connections (the client stays usable; held locks keep theirs)."""
        self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient(
    _ClientBase[AsyncDistributedLock, AsyncDistributedSemaphore, AsyncConnectionPool]
):
    """`Client` for asyncio: the same settings and methods, awaitable, over one
    `AsyncConnectionPool` (use it from one event loop)."""

    _lock_class = AsyncDistributedLock
    _semaphore_class = AsyncDistributedSemaphore
    _pool_class = AsyncConnectionPool

    async def release(self, key: str, token: str, *, limit: int | None = None) -> bool:
        """`Client.release`, awaited."""
        request = _by_token.release_request(_requests.validate_key(key), token, limit)
        _, reply, _ = await send_by_token_async(
            self._pool, self._settings, self._router, key, lambda _, __: request
        )
        return _by_token.released(reply)

    async def hold(
        self, key: str, *, note: str, lease_ttl: int, timeout: float = 0.0, detached: bool = True
    ) -> Hold:
        """`Client.hold`, awaited."""
        return await self._for_hold(key, lease_ttl, timeout).hold(note, detached=detached)

    async def detach(self, key: str, token: str, *, lease_ttl: int) -> bool:
        """`Client.detach`, awaited."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        key, token = _requests.validate_key(key), _requests.validate_token(token)
        return await self._done(
            key, lambda server, where: _by_token.detach_request(server, where, key, token, lease)
        )

    async def renew(self, key: str, token: str, *, lease_ttl: int) -> bool:
        """`Client.renew`, awaited."""
        request = _by_token.renew_request(
            _requests.validate_key(key), token, lease_seconds("lease_ttl", lease_ttl)
        )
        return await self._done(key, lambda _, __: request)

    async def note(self, key: str, token: str, note: str) -> bool:
        """`Client.note`, awaited."""
        key, note = _requests.validate_key(key), _requests.validate_note(note)
        return await self._done(
            key, lambda server, where: _by_token.note_request(server, where, key, token, note)
        )

    async def force_release(self, key: str, *, note: str | None = None) -> int:
        """`Client.force_release`, awaited."""
        key = _requests.validate_key(key)
        if note is not None:
            _requests.validate_note(note, "the operator's note")
        command, reply, at = await send_to_owner_async(
            self._pool,
            self._settings,
            self._router,
            key,
            lambda server, where: _by_token.force_release_request(server, where, key, note),
        )
        return _by_token.freed(command, reply, key, at)

    async def _done(self, key: str, build: BuildAt) -> bool:
        """`Client._done`, awaited."""
        command, reply, at = await send_by_token_async(
            self._pool, self._settings, self._router, key, build
        )
        return _by_token.done(command, reply, key, at)

    async def stats(self, server: tuple[str, int] | str | None = None) -> list[ServerStatus]:
        """`Client.stats`, the servers asked at once."""
        asks = (ask_async(endpoint, True) for endpoint in await self._everyone(server))
        return list(await asyncio.gather(*asks))

    async def ping(self, server: tuple[str, int] | str | None = None) -> list[ServerStatus]:
        """`Client.ping`, the servers asked at once."""
        asks = (ask_async(endpoint, False) for endpoint in await self._everyone(server))
        return list(await asyncio.gather(*asks))

    async def _everyone(self, server: tuple[str, int] | str | None) -> list[Endpoint]:
        if server is None and self._router is not None:
            return self._members(await self.shards())
        return self._endpoints(server)

    async def shards(self, server: tuple[str, int] | str | None = None) -> list[ServerShards]:
        """`Client.shards`, the servers asked at once."""
        asks = (ask_shards_async(endpoint) for endpoint in self._endpoints(server))
        return list(await asyncio.gather(*asks))

    async def close(self) -> None:
        """Close the idle connections (the client stays usable)."""
        await self._pool.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
