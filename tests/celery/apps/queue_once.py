# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""Queue-once tasks (issue 17): ``lock_from="publish"`` holds the key from publish to the end of
the run. Used by tests/celery/test_queue_once_brokers.py, its worker subprocesses and its
publisher subprocesses (``python -m apps.queue_once_publish``).

Every run logs ``started`` (task id, key, fence, the ``dflock_hold`` header's token, the worker's
host name, Celery's retry count) and ``finished`` (with its start and end times), so a test can
tell which message ran, under which hold, and whether two runs of a key overlapped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, cast

from celery import Celery

from celery_dflock import LockedTask
from celery_dflock.signals import lock_skipped

from .common import make_app, record

HOLD_HEADER = "dflock_hold"
"""The message header that carries a publish-time hold (``{"key", "token"}``)."""
BLOCK_LIMIT_S = 60.0
"""Longest a body waits for its release file (a test that forgets it still ends)."""
RETRY_COUNTDOWN_S = 2.0
"""The countdown of `once_retry`'s retry (shorter than the Redis visibility timeout of the
tests, which would otherwise deliver the waiting retry a second time)."""
PURGE_PENDING_TTL_S = 3
"""`once_short_pending`'s ``lock_pending_ttl``: how long a purged message's hold outlives it."""
TICK_S = 0.02


def hold_header(task: LockedTask) -> dict[str, Any] | None:
    """The ``dflock_hold`` header of the current request (None without one)."""
    request: Any = task.request
    found = getattr(request, HOLD_HEADER, None)
    if found is None:
        headers = getattr(request, "headers", None)
        if isinstance(headers, Mapping):
            found = cast("Mapping[str, Any]", headers).get(HOLD_HEADER)
    return dict(cast("Mapping[str, Any]", found)) if isinstance(found, Mapping) else None


def _wait_for(release_file: str | None) -> None:
    deadline = time.monotonic() + BLOCK_LIMIT_S
    while (
        release_file is not None
        and not os.path.exists(release_file)
        and time.monotonic() < deadline
    ):
        time.sleep(TICK_S)


def _run(task: LockedTask, name: str, release_file: str | None) -> str:
    """Log ``started``, wait for ``release_file`` (if any), log ``finished``; the task id."""
    request: Any = task.request
    hold = hold_header(task)
    start = time.time()
    fields = {
        "name": name,
        "task_id": request.id,
        "key": request.dflock_key,
        "fence": request.dflock_fence,
        "token": None if hold is None else hold.get("token"),
        "host": request.hostname,
        "retries": request.retries,
        "redelivered": dict(request.delivery_info or {}).get("redelivered"),
    }
    record("started", start=start, **fields)
    _wait_for(release_file)
    record("finished", start=start, end=time.time(), **fields)
    return str(request.id)


@lock_skipped.connect
def _on_skipped(sender: Any = None, task_id: str | None = None, key: str = "", **kw: Any) -> None:
    record("skipped", task_id=task_id, key=key, holder=kw.get("holder"))


TASK_NAMES = ("once_hold", "once_raise", "once_short_pending", "once_retry", "once_acks_late")


def define_tasks(celery_app: Celery) -> dict[str, Any]:
    """Register the queue-once tasks on ``celery_app`` (the worker's, a publisher's, or a test's
    own client app) under the names ``apps.queue_once.<name>``; returns them by short name."""
    once: dict[str, Any] = {
        "bind": True,
        "base": LockedTask,
        "lock_key": "once:{name}",
        "lock_from": "publish",
        # Not shared: Celery would add a shared task to every app finalized afterwards, and
        # the next define_tasks (or any other test's app) would then meet a second callable
        # under the same name (DuplicateTaskNameWarning, an error in this suite).
        "shared": False,
    }

    def named(name: str) -> dict[str, Any]:
        return {**once, "name": f"apps.queue_once.{name}"}

    @celery_app.task(**named("once_hold"))
    def once_hold(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """Held from publish; a duplicate publish returns the holder's AsyncResult (default)."""
        return _run(self, name, release_file)

    @celery_app.task(**named("once_raise"), on_duplicate="raise")
    def once_raise(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """A duplicate publish raises AlreadyQueued."""
        return _run(self, name, release_file)

    @celery_app.task(**named("once_short_pending"), lock_pending_ttl=PURGE_PENDING_TTL_S)
    def once_short_pending(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """A message may wait ``PURGE_PENDING_TTL_S`` in the queue holding its key."""
        return _run(self, name, release_file)

    @celery_app.task(**named("once_retry"), max_retries=3)
    def once_retry(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """The first run retries after ``RETRY_COUNTDOWN_S``, keeping the key; the retry waits
        for ``release_file`` and ends."""
        if self.request.retries == 0:
            _run(self, name, None)
            raise self.retry(countdown=RETRY_COUNTDOWN_S)
        return _run(self, name, release_file)

    @celery_app.task(**named("once_acks_late"), acks_late=True)
    def once_acks_late(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """Acknowledged after the run: a run killed with its worker is delivered again."""
        return _run(self, name, release_file)

    tasks = {
        "once_hold": once_hold,
        "once_raise": once_raise,
        "once_short_pending": once_short_pending,
        "once_retry": once_retry,
        "once_acks_late": once_acks_late,
    }
    assert tuple(tasks) == TASK_NAMES
    return tasks


app = make_app("apps.queue_once")
TASKS = define_tasks(app)
