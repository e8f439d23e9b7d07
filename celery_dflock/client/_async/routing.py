"""Reaching a key's server: the cluster map's refresh, and one request by token over a pool (asyncio
source of the ``_sync/`` twin). `send_by_token` routes the key as its acquire would and sends the
one request on a pooled connection (to a moving shard's target too: docs/client.md, "A cluster");
`send_to_owner` (a force release) also follows a cluster's ``error_moved`` and ``error_ask``."""

from __future__ import annotations

from collections import abc

from celery_dflock.client import _requests, wire
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._by_token import Request
from celery_dflock.client._replies import Asked, ErrorReply, Moved, Ok, Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._router import REDIRECT_LOOP, ClusterRouter, server_of, split_address
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._settings import ClientSettings, Endpoint
from celery_dflock.client.cluster import ClusterMap
from celery_dflock.client.errors import DflockError, ServerUnavailable

Checkout = abc.Callable[[Endpoint], abc.Awaitable[AsyncConnection]]
Checkin = abc.Callable[[AsyncConnection], abc.Awaitable[None]]
Build = abc.Callable[[ServerInfo | None], Request]  # a request for the server at hand (its `hello`)
BuildAt = abc.Callable[[ServerInfo | None, str], Request]  # `Build`, told its `host:port` too


async def refresh_map(
    router: ClusterRouter, checkout: Checkout, checkin: Checkin, settings: ClientSettings, what: str
) -> None:
    """Fetch the cluster map from the first seed (or known node) that answers, unless a
    refresh started too recently; ``what`` names what needed it."""
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
    checkout: Checkout, checkin: Checkin, endpoint: Endpoint, build: BuildAt, asking: bytes = b""
) -> tuple[Command, Reply]:
    """One request on a pooled connection to ``endpoint`` (``build`` told its address), after
    ``asking`` (if any) was admitted there (a refused one is the reply)."""
    conn = await checkout(endpoint)
    try:
        command, data, timeout = build(conn.server, endpoint.address)
        if asking and not isinstance(admitted := await conn.request(Command.ASKING, asking), Ok):
            return Command.ASKING, admitted
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
    """One request about a grant of ``key`` named by its token, routed as the key's acquire
    is, on a pooled connection: the command sent, its reply, and the server that answered."""
    if router is not None and (router.map is None or router.stale):
        await refresh_map(router, pool.checkout, pool.checkin, settings, f"key {key!r}")
    owner = server_of(key, settings, router)
    endpoint = settings.endpoint(*owner)
    command, reply = await request_once(pool.checkout, pool.checkin, endpoint, build)
    target = None if router is None else router.target(key)
    if target is not None and target != owner and reply == ErrorReply(wire.STATUS_ERROR):
        # Not known at the current member: a key of a split shard may be held at its target.
        endpoint = settings.endpoint(*target)
        command, reply = await request_once(pool.checkout, pool.checkin, endpoint, build)
    return command, reply, endpoint


async def send_to_owner(
    pool: AsyncConnectionPool,
    settings: ClientSettings,
    router: ClusterRouter | None,
    key: str,
    build: BuildAt,
) -> tuple[Command, Reply, Endpoint]:
    """`send_by_token`, following ``error_moved`` and ``error_ask`` (``asking`` first, with
    the member's ticket) up to `REDIRECT_LOOP` times in a row; a refused ``asking`` starts
    over at the key's member."""
    command, reply, endpoint = await send_by_token(pool, settings, router, key, build)
    for _ in range(REDIRECT_LOOP):
        if command is Command.ASKING:
            command, reply, endpoint = await send_by_token(pool, settings, router, key, build)
            continue
        if not isinstance(reply, Moved | Asked):
            break
        if router is not None and isinstance(reply, Moved):
            router.invalidate()
        asking = _requests.checked_asking(key, reply.ticket) if isinstance(reply, Asked) else b""
        endpoint = settings.endpoint(*split_address(reply.address))
        command, reply = await request_once(pool.checkout, pool.checkin, endpoint, build, asking)
    return command, reply, endpoint
