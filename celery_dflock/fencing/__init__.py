"""Fenced writes: the stores Celery tasks write to refuse a holder whose lock went stale.

Every grant of dflockd-server carries a fencing token, ``lock.fence`` (``self.lock.fence`` in a
`LockedTask`), larger than every earlier grant's of the key, across restarts. A store that
keeps the highest fence it accepted for the row or key and refuses a lower one refuses a run
paused past its lease (SIGSTOP, a GC pause, a stalled VM) that resumes and writes.

One module per store, each importing its store's client only when imported itself:
`celery_dflock.fencing.sqlalchemy` (and ``sqlalchemy_aio``), `celery_dflock.fencing.django`,
`celery_dflock.fencing.redis` (and ``redis_aio``).

A fence equal to the highest seen is accepted (a holder writes several times); a lower one
raises `StaleFence`, ``None`` `FenceMissing`, a table without the fence column
`FenceColumnMissing`; none of them writes anything. The fence is checked before the table
(a database without the column says so only at the write). See docs/fencing.md.
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
