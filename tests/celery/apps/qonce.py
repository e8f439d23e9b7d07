# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""Queue-once tasks (``lock_from="publish"``), defined by `define` on any app: the worker
imports this module as ``apps.qonce``, and a test defines the same tasks (same names, same
options) on its own client app, so its ``delay`` goes through ``LockedTask.apply_async``."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery

from celery_dflock import LockedTask
from celery_dflock.signals import lock_skipped

from .common import make_app, record

BLOCK_LIMIT_S = 60.0
TICK_S = 0.05
RETRY_COUNTDOWN_S = 2


def _hold_token(task: LockedTask) -> str | None:
    hold: Any = getattr(task.request, "dflock_hold", None)
    return hold.get("token") if isinstance(hold, dict) else None


def _body(task: LockedTask, name: str, release_file: str | None) -> str:
    lock = task.lock
    record(
        "once_body",
        name=name,
        task_id=task.request.id,
        key=task.request.dflock_key,
        fence=None if lock is None else lock.fence,
        token=task.request.dflock_token,
        hold_token=_hold_token(task),
        retries=task.request.retries,
    )
    start = time.monotonic()
    while release_file is not None and not os.path.exists(release_file):
        if time.monotonic() - start > BLOCK_LIMIT_S:
            break
        time.sleep(TICK_S)
    record("once_done", name=name, task_id=task.request.id)
    return name


@dataclass(frozen=True)
class QonceTasks:
    """The tasks `define` made (untyped Celery task objects)."""

    once: Any
    once_raise: Any
    once_retry: Any
    plain: Any
    run_skip: Any
    collect: Any


def define(app: Celery) -> QonceTasks:
    """Define the queue-once test tasks on ``app`` (names ``apps.qonce.*``)."""

    @app.task(
        name="apps.qonce.once",
        bind=True,
        base=LockedTask,
        lock_key="once:{name}",
        lock_from="publish",
        shared=False,
    )
    def once(self: LockedTask, name: str, release_file: str | None = None) -> str:
        return _body(self, name, release_file)

    @app.task(
        name="apps.qonce.once_raise",
        bind=True,
        base=LockedTask,
        lock_key="once:{name}",
        lock_from="publish",
        on_duplicate="raise",
        shared=False,
    )
    def once_raise(self: LockedTask, name: str, release_file: str | None = None) -> str:
        return _body(self, name, release_file)

    @app.task(
        name="apps.qonce.once_retry",
        bind=True,
        base=LockedTask,
        lock_key="once:{name}",
        lock_from="publish",
        max_retries=3,
        shared=False,
    )
    def once_retry(self: LockedTask, name: str) -> int:
        _body(self, name, None)
        if self.request.retries == 0:
            raise self.retry(countdown=RETRY_COUNTDOWN_S)
        return int(self.request.retries)

    @app.task(
        name="apps.qonce.plain",
        bind=True,
        base=LockedTask,
        lock_key="once:{name}",
        shared=False,
    )
    def plain(self: LockedTask, name: str, release_file: str | None = None) -> str:
        """Locked at run time unless sent with ``lock_from="publish"``."""
        return _body(self, name, release_file)

    @app.task(
        name="apps.qonce.run_skip",
        bind=True,
        base=LockedTask,
        lock_key="once:{name}",
        on_locked="skip",
        shared=False,
    )
    def run_skip(self: LockedTask, name: str) -> str:
        return _body(self, name, None)

    @app.task(name="apps.qonce.collect", shared=False)
    def collect(results: Any) -> Any:
        """A plain task: a chord's callback or a chain's tail (returns what it was given)."""
        record("collect", results=results)
        return results

    return QonceTasks(once, once_raise, once_retry, plain, run_skip, collect)


@lock_skipped.connect
def _on_skipped(
    sender: Any = None,
    task_id: str | None = None,
    key: str = "",
    holder: str | None = None,
    **_: Any,
) -> None:
    record("skipped", task_id=task_id, key=key, holder=holder)


app = make_app("apps.qonce")
tasks = define(app)
