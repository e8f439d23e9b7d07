"""What one server answered to ``hello`` / ``stats`` / ``shards``, as values (no I/O here; the
asking is in ``_async/status.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_dflock.client._servers import ServerInfo
from celery_dflock.client.cluster import ShardsInfo


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
