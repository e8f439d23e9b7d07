"""The Celery app the beat tests run as real ``celery beat`` and ``celery worker`` processes.

Settings come as JSON in ``BEAT_TEST_SETTINGS``. Every message a beat sends is stamped with
the sender's pid, the send time and the time beat reserved the run it sends (headers
``test_pid``, ``test_sent_at``, ``test_run_at``), so a test reads from the broker who sent
which run, and when. A file ``late-send`` in the working directory holds the next
``beatapp.tick`` send for :data:`LATE_SEND_S` after its reserve (and is removed): the late send
of a loaded machine, on cue. ``beatapp.slow`` records each run (start, end, pid)
and every skipped run in Redis lists next to the queue.

``BEAT_TEST_CONFIG``: the text of a docs page's configuration block (``app.conf.... = ...``),
run on the app as a user's module runs it, before the test's own settings (its servers, its
queue, its store's keys) are put over it. ``BEAT_TEST_DJANGO_DATABASE``: Django's
``DATABASES["default"]`` (JSON), for django-celery-beat, as a project's settings module gives it.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals
from celery.beat import PersistentScheduler, ScheduleEntry
from celery.utils.time import maybe_make_aware

from celery_dflock.signals import lock_skipped

logger = logging.getLogger("beatapp")

if os.environ.get("BEAT_TEST_DJANGO_DATABASE"):
    # django-celery-beat's DatabaseScheduler needs a configured Django.
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django_celery_beat"],
        DATABASES={"default": json.loads(os.environ["BEAT_TEST_DJANGO_DATABASE"])},
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()

app = Celery("beatapp", task_cls="celery_dflock.task:LockedTask")
if os.environ.get("BEAT_TEST_CONFIG"):
    exec(compile(os.environ["BEAT_TEST_CONFIG"], "docs block", "exec"), {"app": app})
app.conf.update(json.loads(os.environ.get("BEAT_TEST_SETTINGS", "{}")))


def _records() -> redis.Redis:
    return redis.Redis.from_url(str(app.conf.broker_url))


LATE_SEND = Path("late-send")
LATE_SEND_S = 0.8


def _run_at() -> float | None:
    """When beat reserved the run being sent: the newest ``last_run_at`` among the schedule
    entries in the sending call stack. The scheduler's ``reserve`` returns the run's entry with
    ``last_run_at`` = now; the entry it was given (the run before) is older. Which frame holds
    which differs (Celery's tick, SingletonScheduler's apply_async for RedBeat's sends)."""
    newest: float | None = None
    frame = inspect.currentframe()
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, ScheduleEntry) and value.last_run_at is not None:
                at = maybe_make_aware(value.last_run_at).timestamp()
                newest = at if newest is None else max(newest, at)
        frame = frame.f_back
    return newest


@signals.before_task_publish.connect
def _stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None:
        if headers.get("task") == "beatapp.tick" and LATE_SEND.exists():
            LATE_SEND.unlink()
            time.sleep(LATE_SEND_S)
        headers["test_pid"] = os.getpid()
        headers["test_sent_at"] = time.time()
        headers["test_run_at"] = _run_at()


@app.task(name="beatapp.tick")
def tick() -> None:
    """The 1-second periodic task (the tests count its messages; no worker runs it)."""


@app.task(name="beatapp.slow")
def slow(seconds: float) -> None:
    """A periodic task that runs longer than its period; records [start, end] in Redis."""
    start = time.time()
    time.sleep(seconds)
    record = {"start": start, "end": time.time(), "pid": os.getpid()}
    with _records() as client:
        client.rpush(f"{app.conf.task_default_queue}:runs", json.dumps(record))


@lock_skipped.connect
def _count_skip(sender: Any = None, task_id: str | None = None, key: str = "", **_: Any) -> None:
    record = {"task_id": task_id, "key": key, "at": time.time(), "pid": os.getpid()}
    with _records() as client:
        client.rpush(f"{app.conf.task_default_queue}:skipped", json.dumps(record))


class RecordingScheduler(PersistentScheduler):
    """A custom scheduler for the wrapping test: it marks every send it makes in the log."""

    def setup_schedule(self) -> None:
        logger.info("beatapp: RecordingScheduler in use")
        super().setup_schedule()

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any):
        logger.info("beatapp: RecordingScheduler sends %s", entry.name)
        return super().apply_async(entry, producer, advance, **kwargs)
