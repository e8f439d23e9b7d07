# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""The queue-once tasks (issue 17): ``lock_from="publish"`` holds the key from publish to the end
of the run. The worker subprocesses import this module as ``apps.queue_once``; the publisher
subprocesses (``python -m apps.queue_once_publish``) and the tests define the same tasks (same
names, same options) on their own client app with `define_tasks`, so a ``delay`` goes through
``LockedTask.apply_async``. Used by tests/celery/test_queue_once.py, test_queue_once_edges.py
and test_queue_once_brokers.py.

Every run logs ``started`` (name, task id, key, fence, the run's token, the ``dflock_hold``
header's token as ``hold_token``, the worker's host name, Celery's retry count, whether the
message was redelivered) and ``finished`` (with its start and end times), so a test can tell
which message ran, under which hold, and whether two runs of a key overlapped.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.exceptions import Reject

from celery_dflock import LockedTask, ServerUnavailable
from celery_dflock.signals import lock_skipped

from .common import hold_header, record, record_skipped, wait_for_release, worker_app

RETRY_COUNTDOWN_S = 2.0
"""The countdown of `once_retry`'s retry (shorter than the Redis visibility timeout of the
tests, which would otherwise deliver the waiting retry a second time)."""
AUTORETRY_COUNTDOWN_S = 6.0
"""The countdown of `once_autoretry`'s retry: long enough for a test to start its lock server
again once the first run met the outage."""
LONG_RETRY_COUNTDOWN_S = 8
"""The countdown of `once_long_retry`'s retry: longer than the longest lease the lock server of
its test grants (`LONG_RETRY_MAX_LEASE_S`)."""
LONG_RETRY_MAX_LEASE_S = 5
PURGE_PENDING_TTL_S = 8
"""`once_short_pending`'s ``lock_pending_ttl``: how long a purged message's hold outlives it.
The test checks the key is still held (a duplicate publish, message counts, a purge) before
this runs out: 3 s was too short for those steps on a loaded CI machine."""


def _run(task: LockedTask, name: str, release_file: str | None) -> str:
    """Log ``started``, wait for ``release_file`` (if any), log ``finished``; returns ``name``."""
    request: Any = task.request
    hold = hold_header(request)
    start = time.time()
    fields = {
        "name": name,
        "task_id": request.id,
        "key": request.dflock_key,
        "fence": request.dflock_fence,
        "token": request.dflock_token,
        "hold_token": None if hold is None else hold.get("token"),
        "host": request.hostname,
        "retries": request.retries,
        "redelivered": dict(request.delivery_info or {}).get("redelivered"),
    }
    record("started", start=start, **fields)
    wait_for_release(release_file)
    record("finished", start=start, end=time.time(), **fields)
    return name


lock_skipped.connect(record_skipped)

TASK_NAMES = (
    "once",
    "once_raise",
    "once_short_pending",
    "once_retry",
    "once_acks_late",
    "once_reject",
    "once_autoretry",
    "once_long_retry",
    "plain",
    "run_skip",
    "collect",
)


def define_tasks(celery_app: Celery) -> dict[str, Any]:
    """Register the queue-once tasks on ``celery_app`` (the worker's, a publisher's, or a test's
    own client app) under the names ``apps.queue_once.<name>``; returns them by short name."""
    locked: dict[str, Any] = {
        "bind": True,
        "base": LockedTask,
        "lock_key": "once:{name}",
        # Not shared: Celery would add a shared task to every app finalized afterwards, and
        # the next define_tasks (or any other test's app) would then meet a second callable
        # under the same name (DuplicateTaskNameWarning, an error in this suite).
        "shared": False,
    }
    once = {**locked, "lock_from": "publish"}

    def named(name: str, options: dict[str, Any]) -> dict[str, Any]:
        return {**options, "name": f"apps.queue_once.{name}"}

    @celery_app.task(**named("once", once))
    def once_(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """Held from publish; a duplicate publish returns the holder's AsyncResult (default)."""
        return _run(self, name, release_file)

    @celery_app.task(**named("once_raise", once), on_duplicate="raise")
    def once_raise(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """A duplicate publish raises AlreadyQueued."""
        return _run(self, name, release_file)

    @celery_app.task(**named("once_short_pending", once), lock_pending_ttl=PURGE_PENDING_TTL_S)
    def once_short_pending(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """A message may wait ``PURGE_PENDING_TTL_S`` in the queue holding its key."""
        return _run(self, name, release_file)

    @celery_app.task(**named("once_retry", once), max_retries=3)
    def once_retry(self: LockedTask, name: str, release_file: str | None = None) -> int:
        """The first run retries after ``RETRY_COUNTDOWN_S``, keeping the key; the retry waits
        for ``release_file`` and ends, returning its retry count."""
        if self.request.retries == 0:
            _run(self, name, None)
            raise self.retry(countdown=RETRY_COUNTDOWN_S)
        _run(self, name, release_file)
        return int(self.request.retries)

    @celery_app.task(**named("once_acks_late", once), acks_late=True)
    def once_acks_late(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """Acknowledged after the run: a run killed with its worker is delivered again."""
        return _run(self, name, release_file)

    @celery_app.task(**named("once_reject", once), acks_late=True)
    def once_reject(self: LockedTask, name: str, release_file: str, requeue: bool = True) -> str:
        """The first delivery waits for ``release_file``, logs ``rejecting`` and raises
        ``Reject(requeue=requeue)`` (acks_late: a rejected message is not acknowledged yet);
        a delivery after it (``release_file`` + ``.rejected`` exists) runs and ends."""
        rejected = f"{release_file}.rejected"
        if os.path.exists(rejected):
            return _run(self, name, None)
        _run(self, name, release_file)
        with open(rejected, "w", encoding="utf-8"):
            pass
        record("rejecting", name=name, task_id=self.request.id, requeue=requeue)
        raise Reject("rejected by the test", requeue=requeue)

    @celery_app.task(
        **named("once_autoretry", once),
        autoretry_for=(ServerUnavailable,),
        retry_kwargs={"countdown": AUTORETRY_COUNTDOWN_S},
        max_retries=3,
    )
    def once_autoretry(self: LockedTask, name: str) -> str:
        """An outage taking the lock (or the hold) over is retried by Celery's autoretry."""
        return _run(self, name, None)

    @celery_app.task(
        **named("once_long_retry", once), lock_pending_ttl=3, lock_ttl=3, max_retries=1
    )
    def once_long_retry(self: LockedTask, name: str) -> str:
        """The first run retries after `LONG_RETRY_COUNTDOWN_S`; the retry ends."""
        _run(self, name, None)
        if self.request.retries == 0:
            raise self.retry(countdown=LONG_RETRY_COUNTDOWN_S)
        return name

    @celery_app.task(**named("plain", locked))
    def plain(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """Locked at run time unless sent with ``lock_from="publish"``."""
        return _run(self, name, release_file)

    @celery_app.task(**named("run_skip", locked), on_locked="skip")
    def run_skip(self: LockedTask, name: str) -> str:
        return _run(self, name, None)

    @celery_app.task(name="apps.queue_once.collect", shared=False)
    def collect(results: Any) -> Any:
        """A plain task: a chord's callback or a chain's tail (returns what it was given)."""
        record("collect", results=results)
        return results

    tasks = {
        "once": once_,
        "once_raise": once_raise,
        "once_short_pending": once_short_pending,
        "once_retry": once_retry,
        "once_acks_late": once_acks_late,
        "once_reject": once_reject,
        "once_autoretry": once_autoretry,
        "once_long_retry": once_long_retry,
        "plain": plain,
        "run_skip": run_skip,
        "collect": collect,
    }
    assert tuple(tasks) == TASK_NAMES
    return tasks


app = worker_app("apps.queue_once")
TASKS = define_tasks(app)
