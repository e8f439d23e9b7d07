"""Asking one server ``hello``, ``stats`` or ``shards`` over a connection of its own: never
raising for a server that cannot be reached, saying so in the answer (asyncio source of the
``_sync/`` twin).
"""

from __future__ import annotations

from celery_dflock.client import _requests
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._requests import Command
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._settings import Endpoint
from celery_dflock.client._status import (
    ServerShards,
    ServerStatus,
    hello_only,
    shards_of,
    with_stats,
)
from celery_dflock.client.errors import DflockError


async def ask_shards(endpoint: Endpoint) -> ServerShards:
    try:
        conn = await AsyncConnection.connect(endpoint, None)
        try:
            data = await conn.shards()
        finally:
            await conn.aclose()
    except DflockError as exc:
        return ServerShards(endpoint.address, error=str(exc))
    return shards_of(endpoint, data)


async def ask(endpoint: Endpoint, with_stats_too: bool) -> ServerStatus:
    try:
        conn = await AsyncConnection.connect(endpoint, None)
        try:
            info = conn.server or ServerInfo()
            done = hello_only(endpoint, info, with_stats_too)
            if done is not None:
                return done
            reply = await conn.request(Command.STATS, _requests.encode_stats())
        finally:
            await conn.aclose()
    except DflockError as exc:
        return ServerStatus(endpoint.address, error=str(exc))
    return with_stats(endpoint, info, reply)
