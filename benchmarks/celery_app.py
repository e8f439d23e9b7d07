# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""The Celery app of the ``celery_tasks`` benchmark (its workers run ``-A benchmarks.celery_app``).

The worker gets its whole configuration as JSON in ``DFLOCK_BENCH_SETTINGS``. Every task body
appends ``<i> <start> <end>`` (wall clock seconds) to the file named by ``DFLOCK_BENCH_LOG``
(``O_APPEND``: lines from the pool processes never interleave) and does nothing else, so what
differs between the variants is the lock alone.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

from celery_dflock import LockedTask

SETTINGS_ENV = "DFLOCK_BENCH_SETTINGS"
LOG_ENV = "DFLOCK_BENCH_LOG"
REDIS_LOCK_URL_ENV = "DFLOCK_BENCH_REDIS_LOCK_URL"
LOCK_TTL_S = 60
WAIT_S = 10
SHARED_KEYS = 10
BUSY_KEYS = 5
"""Keys of the busy-keys batch (`benchmarks.contention`): task ``i`` locks ``i % BUSY_KEYS``."""
BUSY_BODY_S = 0.25
"""How long a busy-keys task body runs (sleeping, so a gevent worker yields)."""

app = Celery("dflock-bench", set_as_current=False)
app.conf.update(json.loads(os.environ.get(SETTINGS_ENV) or "{}"))


def record(i: int, start: float) -> None:
    line = b"%d %.6f %.6f\n" % (i, start, time.time())
    fd = os.open(os.environ[LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class RedisLockTask(Task):  # type: ignore[misc]
    """A task holding one redis-py client per pool process (created after the fork)."""

    abstract = True
    _client: redis.Redis | None = None

    @property
    def redis(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(os.environ[REDIS_LOCK_URL_ENV])
        return self._client


@app.task(name="bench.plain", ignore_result=True)
def plain(i: int) -> None:
    record(i, time.time())


@app.task(name="bench.locked", base=LockedTask, lock_key="bench-locked:{i}", ignore_result=True)
def locked(i: int) -> None:
    record(i, time.time())


@app.task(
    name="bench.locked_shared",
    base=LockedTask,
    lock_key="bench-shared:{k}",
    lock_timeout=WAIT_S,
    ignore_result=True,
)
def locked_shared(i: int, k: int) -> None:
    record(i, time.time())


@app.task(name="bench.redis_lock", base=RedisLockTask, bind=True, ignore_result=True)
def redis_lock(self: Any, i: int) -> None:
    with self.redis.lock(f"bench-redis:{i}", timeout=LOCK_TTL_S, blocking_timeout=WAIT_S):
        record(i, time.time())


@app.task(name="bench.busy", base=LockedTask, lock_key="bench-busy:{k}", ignore_result=True)
def busy(i: int, k: int) -> None:
    """The busy-keys batch's task: the lock options are the message's (or the defaults)."""
    start = time.time()
    time.sleep(BUSY_BODY_S)
    record(i, start)
