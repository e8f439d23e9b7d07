"""The Celery app the beat tests run as real ``celery beat`` and ``celery worker`` processes.

Settings come as JSON in ``BEAT_TEST_SETTINGS``. Every message a beat sends is stamped with
the sender's pid and the send time (headers ``test_pid``, ``test_sent_at``), so a test reads
from the broker who sent what, and when. ``beatapp.slow`` records each run (start, end, pid)
and every skipped run in Redis lists next to the queue.

``BEAT_TEST_CONFIG``: the text of a docs page's configuration block (``app.conf.... = ...``),
run on the app as a user's module runs it, before the test's own settings (its servers, its
queue, its store's keys) are put over it. ``BEAT_TEST_DJANGO_DATABASE``: Django's
``DATABASES["default"]`` (JSON), for django-celery-beat, as a project's settings module gives it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import redis
from celery import Celery, signals
from celery.beat import PersistentScheduler

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


@signals.before_task_publish.connect
def _stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None:
        headers["test_pid"] = os.getpid()
        headers["test_sent_at"] = time.time()


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
