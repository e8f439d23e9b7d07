"""Reaching a key's server: the cluster map's refresh, and one request by token over a pool.

Written once for both faces: the asyncio source, ``celery_dflock/client/_async/routing.py``,
and the blocking twin that ``scripts/unasync.py`` generates from it in ``_sync/``. A lock's
acquire routes through its `LockCore` (`celery_dflock.client._router.KeyRoute`); a client's
request by token (`Client.release`, ``renew``, ``detach``, ``note``) needs no lock object:
`send_by_token` routes the key by the client's settings (or its cached cluster map) and sends
the one request on a pooled connection; `send_to_owner` (a force release) follows the
``error_moved`` a cluster member answers too.
"""

from __future__ import annotations

from collections import abc

from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._by_token import Request
from celery_dflock.client._replies import Moved, Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._router import REDIRECT_LOOP, ClusterRouter, split_address
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._settings import ClientSettings, Endpoint
from celery_dflock.client.cluster import ClusterMap
from celery_dflock.client.errors import DflockError, ServerUnavailable
from celery_dflock.client.sharding import select_server

Checkout = abc.Callable[[Endpoint], abc.Awaitable[AsyncConnection]]
"""Where a connection to an endpoint comes from (a pool's ``checkout``, a lock's own)."""
Checkin = abc.Callable[[AsyncConnection], abc.Awaitable[None]]
"""Where it goes back to."""
Build = abc.Callable[[ServerInfo | None], Request]
"""Makes a request for the server at hand (what it said to ``hello``)."""
BuildAt = abc.Callable[[ServerInfo | None, str], Request]
"""`Build`, told the server's ``host:port`` too (for its messages)."""


async def refresh_map(
    router: ClusterRouter, checkout: Checkout, checkin: Checkin, settings: ClientSettings, what: str
) -> None:
    """Fetch the cluster map from the first seed (or known node) that answers, unless a
    refresh started too recently (`ClusterRouter.claim_refresh`); ``what`` (``lock 'k'``)
    names what needed it when no seed answers."""
    if not router.claim_refresh():
        return
    failures: list[str] = []
    for host, port in router.candidates():
        endpoint = settings.endpoint(host, port)
        try:
            conn = await checkout(endpoint)
            try:
                data = await conn.shards()
            finally:
                await checkin(conn)
            if data is None:
                failures.append(f"{endpoint.address} does not answer shards")
                continue
            router.update(ClusterMap.parse(data, endpoint.address))
            return
        except DflockError as exc:
            failures.append(str(exc))
    if router.map is None:
        raise ServerUnavailable(
            f"no seed of the cluster answered shards for {what} "
            f"({'; '.join(failures)}); check servers= (in Celery `dflock_servers`): with "
            "sharding_strategy='cluster' they must be members of the cluster"
        )


async def request_once(
    checkout: Checkout, checkin: Checkin, endpoint: Endpoint, build: Build
) -> tuple[Command, Reply]:
    """One request on a connection to ``endpoint``, given back after: the command sent and its
    reply (an interrupted request closes its connection, which is then not kept)."""
    conn = await checkout(endpoint)
    try:
        command, data, timeout = build(conn.server)
        reply = await conn.request(command, data, timeout)
    finally:
        await checkin(conn)
    return command, reply


async def send_by_token(
    pool: AsyncConnectionPool,
    settings: ClientSettings,
    router: ClusterRouter | None,
    key: str,
    build: BuildAt,
) -> tuple[Command, Reply, Endpoint]:
    """One request about a grant of ``key`` named by its token, without a lock object: routed
    as the key's acquire is (the list's shard; in cluster mode the cached map, fetched first
    when there is none or it is stale), sent on a pooled connection. The command sent, its
    reply, and the server that answered."""
    servers = settings.servers
    if router is None:
        owner = servers[select_server(key, servers, settings.sharding_strategy)]  # pyright: ignore[reportArgumentType]
    else:
        if router.map is None or router.stale:
            await refresh_map(router, pool.checkout, pool.checkin, settings, f"key {key!r}")
        owner = router.owner(key) or servers[0]
    endpoint = settings.endpoint(*owner)
    address = endpoint.address
    command, reply = await request_once(
        pool.checkout, pool.checkin, endpoint, lambda server: build(server, address)
    )
    return command, reply, endpoint


async def send_to_owner(
    pool: AsyncConnectionPool,
    settings: ClientSettings,
    router: ClusterRouter | None,
    key: str,
    build: BuildAt,
) -> tuple[Command, Reply, Endpoint]:
    """`send_by_token`, and in cluster mode the ``error_moved`` replies followed to the member
    they name (up to `REDIRECT_LOOP` in a row; the cached map is read again next time)."""
    command, reply, endpoint = await send_by_token(pool, settings, router, key, build)
    for _ in range(REDIRECT_LOOP):
        if not isinstance(reply, Moved):
            break
        if router is not None:
            router.invalidate()
        endpoint = settings.endpoint(*split_address(reply.address))
        address = endpoint.address
        command, reply = await request_once(
            pool.checkout, pool.checkin, endpoint, lambda server, at=address: build(server, at)
        )
    return command, reply, endpoint
