"""What one server answered to ``hello`` / ``stats`` / ``shards``, as values (no I/O here; the
asking is in ``_async/status.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from celery_dflock.client import wire
from celery_dflock.client._replies import ErrorReply, Reply, Stats
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._settings import Endpoint
from celery_dflock.client.cluster import ShardsInfo
from celery_dflock.client.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """What one server answered: ``server`` its ``hello`` (None when unreachable: ``error``
    says why), ``stats`` its ``stats`` JSON (None when not asked or not answered)."""

    address: str
    server: ServerInfo | None = None
    stats: dict[str, Any] | None = None
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.server is not None


@dataclass(frozen=True, slots=True)
class ServerShards:
    """What one server answered to ``shards`` (None: ``error`` says why)."""

    address: str
    shards: ShardsInfo | None = None
    error: str | None = None


def shards_of(endpoint: Endpoint, data: dict[str, object] | None) -> ServerShards:
    if data is None:
        return ServerShards(
            endpoint.address, error="does not answer shards (an older or foreign server)"
        )
    try:
        return ServerShards(endpoint.address, ShardsInfo.parse(data, endpoint.address))
    except ProtocolError as exc:
        return ServerShards(endpoint.address, error=str(exc))


def hello_only(endpoint: Endpoint, info: ServerInfo, with_stats: bool) -> ServerStatus | None:
    """The status when ``stats`` is not to be asked (None: ask it; a server without ``hello``
    may still know ``stats``)."""
    if with_stats and (info.legacy or info.supports(wire.FEATURE_STATS)):
        return None
    return ServerStatus(endpoint.address, info)


def with_stats(endpoint: Endpoint, info: ServerInfo, reply: Reply) -> ServerStatus:
    if isinstance(reply, Stats):
        return ServerStatus(endpoint.address, info, cast("dict[str, Any]", reply.data))
    if isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR:
        return ServerStatus(endpoint.address, info)  # it answers, but has no stats
    return ServerStatus(endpoint.address, error=f"unexpected reply to stats: {reply!r}")
