"""Asking one server ``hello``, ``stats`` or ``shards`` over a connection of its own: never raising
for an unreachable server, saying so in the answer (asyncio source of the ``_sync/`` twin)."""

from __future__ import annotations

from typing import Any, cast

from celery_dflock.client import _requests, wire
from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._replies import ErrorReply, JsonReply
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._settings import Endpoint
from celery_dflock.client._status import ServerShards, ServerStatus
from celery_dflock.client.cluster import ShardsInfo
from celery_dflock.client.errors import DflockError


async def ask_shards(endpoint: Endpoint) -> ServerShards:
    try:
        conn = await AsyncConnection.connect(endpoint, None)
        try:
            data = await conn.shards()
        finally:
            await conn.aclose()
        if data is None:
            return ServerShards(
                endpoint.address, error="does not answer shards (an older or foreign server)"
            )
        return ServerShards(endpoint.address, ShardsInfo.parse(data, endpoint.address))
    except DflockError as exc:  # a ProtocolError of the answer included
        return ServerShards(endpoint.address, error=str(exc))


async def ask(endpoint: Endpoint, with_stats: bool) -> ServerStatus:
    """``hello``, and ``stats`` when ``with_stats`` and the server may know it (one without
    ``hello`` may still know ``stats``)."""
    try:
        conn = await AsyncConnection.connect(endpoint, None)
        try:
            info = conn.server or ServerInfo()
            if not (with_stats and (info.legacy or info.supports(wire.FEATURE_STATS))):
                return ServerStatus(endpoint.address, info)
            reply = await conn.request(_requests.Command.STATS, _requests.STATS_REQUEST)
        finally:
            await conn.aclose()
    except DflockError as exc:
        return ServerStatus(endpoint.address, error=str(exc))
    if isinstance(reply, JsonReply):
        return ServerStatus(endpoint.address, info, cast("dict[str, Any]", reply.data))
    if isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR:
        return ServerStatus(endpoint.address, info)  # it answers, but has no stats
    return ServerStatus(endpoint.address, error=f"unexpected reply to stats: {reply!r}")
