"""Fenced writes: the stores Celery tasks write to refuse a holder whose lock went stale.

Every grant of dflockd-server carries a fencing token, ``lock.fence`` (``self.lock.fence`` in a
`LockedTask`), larger than every earlier grant's of the key, across restarts. A write that
carries it, to a store that keeps the highest fence it has accepted for the row or key and
refuses a lower one, cannot land after a later holder's: a run paused past its lease (SIGSTOP,
a long GC pause, a stalled VM) that resumes and writes is refused by the store, whatever it
believes it holds.

One module per store, each importing its store's client only when imported itself (so
``import celery_dflock`` and ``import celery_dflock.fencing`` load none of them):

* `celery_dflock.fencing.sqlalchemy`: ``fenced_update(connection, table, where, fence=...,
  values=...)``, one ``UPDATE ... WHERE <where> AND dflock_fence <= :fence`` (Core or ORM,
  any database SQLAlchemy speaks; tested on PostgreSQL), and ``fenced_upsert(connection,
  table, key=..., fence=..., values=...)``, one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE``
  (PostgreSQL, SQLite, MySQL and MariaDB); `celery_dflock.fencing.sqlalchemy_aio`, the same
  for ``AsyncConnection`` and ``AsyncSession``;
* `celery_dflock.fencing.django`: ``fenced_update(queryset_or_model, fence, **values)`` and
  ``fenced_upsert(model, fence, key=..., values=...)``, the same through Django's ORM, and
  ``fence_field()`` for the model;
* `celery_dflock.fencing.redis`: ``fenced_set`` and ``fenced_hset``, one Lua script each;
  `celery_dflock.fencing.redis_aio`, the same for ``redis.asyncio``.

Each write with a fence equal to the highest seen is accepted (a holder writes several times
under its one fence); a lower one raises `StaleFence`; a missing one (``None``: a lock server
without fencing tokens) raises `FenceMissing`; a table without the fence column raises
`FenceColumnMissing` (``check_fence_column`` / ``check_fence_field`` check it at deploy). None
of them writes anything. See docs/fencing.md.
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
