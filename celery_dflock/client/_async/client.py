"""`AsyncClient`, the asyncio source of the blocking `Client` that ``scripts/unasync.py`` generates
in ``_sync/`` (how to use them: docs/client.md): one `ClientSettings`, checked once here or by the
Celery layer (`from_settings`), and one pool, shared by the locks it makes; a request by token is
one request on a pooled connection to the key's server (`celery_dflock.client._async.routing`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from ssl import SSLContext
from typing import Self, TypeVar, cast

from celery_dflock.client import _by_token, _requests
from celery_dflock.client._aio_backend import gather
from celery_dflock.client._async.lock import AsyncDistributedLock, AsyncDistributedSemaphore
from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._async.routing import send_by_token, send_to_owner
from celery_dflock.client._async.status import ask, ask_shards
from celery_dflock.client._core import LockCore
from celery_dflock.client._replies import Ok
from celery_dflock.client._router import ClusterRouter, server_of, split_address
from celery_dflock.client._servers import Hold, ServerInfo
from celery_dflock.client._settings import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    DEFAULT_SESSION_TTL_S,
    ClientSettings,
    Endpoint,
    check_limit,
    lease_seconds,
    whole_seconds,
)
from celery_dflock.client._status import ServerShards, ServerStatus
from celery_dflock.client.errors import InvalidValueError
from celery_dflock.client.sharding import CLUSTER, Routing, stable_hash_shard

__all__ = ["AsyncClient"]

T = TypeVar("T")
ByToken = Callable[[ServerInfo | None, str, str, str, T], _by_token.Request]
"""Builds a request by token: (server, its ``host:port``, key, token, lease or note)."""


class AsyncClient:
    """Locks, semaphores, requests by token, stats and ping over one pool (`Client`: thread and fork
    safe; `AsyncClient`: for one event loop). Arguments as `DistributedLock`'s, held once;
    ``acquire_timeout_s`` and ``lease_ttl_s`` are the defaults of every lock it makes."""

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
        """A client on ``settings`` validated already (by the Celery layer)."""
        client = cls.__new__(cls)
        client._setup(settings)
        return client

    def _setup(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._pool = AsyncConnectionPool()
        self._router = (
            ClusterRouter(settings.servers) if settings.sharding_strategy == CLUSTER else None
        )

    @property
    def pool(self) -> AsyncConnectionPool:
        return self._pool

    @property
    def settings(self) -> ClientSettings:
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

    def lock(
        self,
        key: str,
        *,
        acquire_timeout_s: float | None = None,
        lease_ttl_s: int | None = None,
        on_lost: Callable[[AsyncDistributedLock], object] | None = None,
        note: str | None = None,
    ) -> AsyncDistributedLock:
        """An unacquired lock on ``key``; None: the client's default. ``note``: the owner note
        each acquire gives a server with holds (``stats`` and ``lock.holder`` show it)."""
        core = self._core(key, acquire_timeout_s, lease_ttl_s, note=note)
        return AsyncDistributedLock._of(core, on_lost, self._pool)  # pyright: ignore[reportPrivateUsage]

    def semaphore(
        self,
        key: str,
        limit: int,
        *,
        acquire_timeout_s: float | None = None,
        lease_ttl_s: int | None = None,
        on_lost: Callable[[AsyncDistributedSemaphore], object] | None = None,
    ) -> AsyncDistributedSemaphore:
        """An unacquired semaphore of ``limit`` slots on ``key``."""
        slots = check_limit(limit, semaphore=True)
        core = self._core(key, acquire_timeout_s, lease_ttl_s, limit=slots)
        return AsyncDistributedSemaphore._of(core, on_lost, self._pool)  # pyright: ignore[reportPrivateUsage]

    def _core(
        self,
        key: str,
        acquire_timeout_s: float | None,
        lease_ttl_s: int | None,
        *,
        limit: int | None = None,
        note: str | None = None,
    ) -> LockCore:
        """A lock's core, its timeout and lease checked here (None: the client's)."""
        if acquire_timeout_s is not None:
            acquire_timeout_s = whole_seconds("acquire_timeout_s", acquire_timeout_s, minimum=0)
        return LockCore(
            key,
            self._settings,
            limit=limit,
            acquire_timeout_s=acquire_timeout_s,
            lease_ttl_s=None if lease_ttl_s is None else lease_seconds("lease_ttl_s", lease_ttl_s),
            router=self._router,
            note=note,
        )

    def server_for(self, key: str) -> tuple[str, int]:
        """The ``(host, port)`` that owns ``key`` (no I/O; in cluster mode by the cached map,
        the first seed while there is none); ``key`` is checked as a lock's is."""
        return server_of(_requests.validate_key(key), self._settings, self._router)

    async def hold(
        self, key: str, *, note: str, lease_ttl: int, timeout: float = 0.0, detached: bool = True
    ) -> Hold:
        """Take a detached hold of the lock ``key`` (``hl ... d``): it survives this process
        and ends only when its token is released (from any process) or its lease of
        ``lease_ttl`` seconds runs out. ``note`` names the owner. Waits up to ``timeout``
        seconds for a busy key (0: try once); `KeyHeld` when it stays busy.

        ``detached=False``: the grant stays bound to the pooled connection that took it until
        `detach` (a publish-time hold confirmed only once its message is sent)."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        wait = whole_seconds("timeout", timeout, minimum=0)
        lock = AsyncDistributedLock._of(self._core(key, wait, lease), None, self._pool)  # pyright: ignore[reportPrivateUsage]
        return await lock.hold(note, detached=detached)

    async def release(self, key: str, token: str, *, limit: int | None = None) -> bool:
        """Release ``token`` on ``key`` (``limit``: a semaphore's slot): True if the server
        released it, False if it no longer held it."""
        semaphore = check_limit(limit) is not None
        request = _by_token.release_request(_requests.validate_key(key), token, semaphore=semaphore)
        _, reply, _ = await send_by_token(
            self._pool, self._settings, self._router, key, lambda _, __: request
        )
        return isinstance(reply, Ok)

    async def detach(self, key: str, token: str, *, lease_ttl: int) -> bool:
        """Detach ``token``'s grant on ``key`` from its connection (``hd``) with a lease of
        ``lease_ttl`` seconds: False if it no longer holds the key."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        return await self._done(_by_token.detach_request, key, token, lease)

    async def renew(self, key: str, token: str, *, lease_ttl: int) -> bool:
        """Renew ``token`` on ``key`` to ``lease_ttl`` s: False if it no longer holds the key."""
        lease = lease_seconds("lease_ttl", lease_ttl)
        return await self._done(_by_token.renew_request, key, token, lease)

    async def note(self, key: str, token: str, note: str) -> bool:
        """Replace ``token``'s owner note on ``key``: False if it no longer holds the key."""
        return await self._done(_by_token.note_request, key, token, _requests.validate_note(note))

    async def force_release(self, key: str, *, note: str | None = None) -> int:
        """Free ``key`` whoever holds it (an operator's act, ``fr``): every grant on it ends
        now, and the old holder learns its loss at its next renewal. ``note`` names who asks
        in the server's log. Returns how many grants were freed."""
        key = _requests.validate_key(key)
        if note is not None:
            _requests.validate_note(note, "the operator's note")
        build = partial(_by_token.force_release_request, key=key, note=note)
        command, reply, at = await send_to_owner(
            self._pool, self._settings, self._router, key, build
        )
        return _by_token.freed(command, reply, key, at)

    async def _done(self, build: ByToken[T], key: str, token: str, last: T) -> bool:
        """``build``'s request about ``token`` on ``key`` (both checked here, before any I/O;
        ``last``: its lease or note, checked already): True done."""
        key, token = _requests.validate_key(key), _requests.validate_token(token)
        command, reply, at = await send_by_token(
            self._pool,
            self._settings,
            self._router,
            key,
            lambda server, where: build(server, where, key, token, last),
        )
        return _by_token.done(command, reply, key, at)

    async def stats(self, server: tuple[str, int] | str | None = None) -> list[ServerStatus]:
        """Every server's (or ``server``'s) ``stats``, never raising for an unreachable one (in
        cluster mode every member's)."""
        return await gather(ask(endpoint, True) for endpoint in await self._everyone(server))

    async def ping(self, server: tuple[str, int] | str | None = None) -> list[ServerStatus]:
        """Whether every server (or ``server``) answers; an unreachable one has ``error``."""
        return await gather(ask(endpoint, False) for endpoint in await self._everyone(server))

    async def shards(self, server: tuple[str, int] | str | None = None) -> list[ServerShards]:
        """What every server (or ``server``) answers to ``shards``, never raising for an
        unreachable one."""
        return await gather(ask_shards(endpoint) for endpoint in self._endpoints(server))

    async def _everyone(self, server: tuple[str, int] | str | None) -> list[Endpoint]:
        """`_endpoints`; in cluster mode the seeds, then every member their ``shards`` name."""
        if server is not None or self._router is None:
            return self._endpoints(server)
        found = dict.fromkeys(self._settings.servers)  # in order, each once
        for answer in await self.shards():
            info = answer.shards
            if info is not None:
                nodes = () if info.cluster is None else info.cluster.nodes
                found.update(dict.fromkeys(map(split_address, [*info.members, *nodes])))
        return [self._settings.endpoint(*address) for address in found]

    def _endpoints(self, server: tuple[str, int] | str | None) -> list[Endpoint]:
        """``server`` (``"host:port"`` or ``(host, port)``, as ``servers`` lists it), or all."""
        if server is None:
            return self._settings.endpoints()
        address: object = server
        if isinstance(server, str):
            host, _, port = server.rpartition(":")
            address = (host.strip("[]"), int(port)) if port.isdigit() else None
        elif isinstance(server, list):  # as ``servers`` takes it
            address = tuple(cast("list[object]", server))
        if address not in self._settings.servers:
            known = ", ".join(f"{host}:{port}" for host, port in self._settings.servers)
            raise InvalidValueError(
                f"server={server!r} is not one of this client's servers ({known}): give one "
                "of them as 'host:port' or (host, port)"
            )
        return [self._settings.endpoint(*cast("tuple[str, int]", address))]

    async def close(self) -> None:
        """Close the idle connections, having ended each client session that holds no lock object
        (what it held by token ends with it); the client stays usable, held locks keep theirs."""
        await self._pool.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        servers = ",".join(f"{host}:{port}" for host, port in self._settings.servers)
        return f"{type(self).__name__}({servers})"
