# pyright: reportUntypedFunctionDecorator=false
# (Celery's @app.task is untyped.)
"""The Celery app of the ``held`` benchmark's gevent worker (``-A benchmarks.held_app``).

The worker gets its configuration as JSON in ``DFLOCK_HELD_SETTINGS``. A task body appends
``start <i> <wall s>`` to the file named by ``DFLOCK_HELD_LOG`` (``O_APPEND``), sleeps for
``hold_s`` (gevent's ``time.sleep``: the greenlet yields), and appends ``end <i> <wall s>``.
The two tasks differ by the lock alone: ``held.locked`` is a `LockedTask` on a key of its own.

This module imports nothing else of ``benchmarks``: on side A of the benchmark's A/B, the
worker's ``celery_dflock`` is another checkout's, put first on ``PYTHONPATH``, and only this
module is taken from this one.
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from celery_dflock import LockedTask

SETTINGS_ENV = "DFLOCK_HELD_SETTINGS"
LOG_ENV = "DFLOCK_HELD_LOG"
LOCKED_KEY_PREFIX = "held-task-"

app = Celery("dflock-held", set_as_current=False)
app.conf.update(json.loads(os.environ.get(SETTINGS_ENV) or "{}"))


def record(what: str, i: int) -> None:
    line = b"%s %d %.6f\n" % (what.encode(), i, time.time())
    fd = os.open(os.environ[LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def sleep_through(i: int, hold_s: float) -> None:
    record("start", i)
    time.sleep(hold_s)
    record("end", i)


@app.task(name="held.plain", ignore_result=True)
def plain(i: int, hold_s: float) -> None:
    sleep_through(i, hold_s)


@app.task(
    name="held.locked", base=LockedTask, lock_key=LOCKED_KEY_PREFIX + "{i}", ignore_result=True
)
def locked(i: int, hold_s: float) -> None:
    sleep_through(i, hold_s)
