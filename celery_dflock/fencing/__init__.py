"""Fenced writes: the stores Celery tasks write to refuse a holder whose lock went stale (what
each write does, and why: docs/fencing.md).

One module per store, each importing its store's client only when imported itself:
`celery_dflock.fencing.sqlalchemy` (and ``sqlalchemy_aio``), `celery_dflock.fencing.django`,
`celery_dflock.fencing.redis` (and ``redis_aio``). The fence is checked before the table: a
``None`` fence raises `FenceMissing` even where the column is missing (a database without it
says so only at the write).
"""

from __future__ import annotations

from celery_dflock.fencing.errors import FenceColumnMissing, FenceMissing, StaleFence
from celery_dflock.fencing.fences import FENCE_COLUMN, MAX_FENCE, require_fence

__all__ = [
    "FENCE_COLUMN",
    "MAX_FENCE",
    "FenceColumnMissing",
    "FenceMissing",
    "StaleFence",
    "require_fence",
]
