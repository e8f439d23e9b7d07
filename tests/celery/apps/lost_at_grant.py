# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""Locked tasks whose lock is lost after its grant and before the body starts.

Fault injection in the worker: the run's step between the grant and the body (recording the
lock on the request, ``celery_dflock._run.mark_held``) is wrapped so that, for a key under
``grant:``, it first frees the key through a second real client (the operator's force
release, ``fr``, on the real server), then waits until this process's ``lock_lost`` signal has
been sent for it (the run's lost-lock guard has been told), and only then goes on.
"""

from __future__ import annotations

import threading
from typing import Any

import celery_dflock._run as locked_run_module
from celery_dflock import LockedTask, LockLost
from celery_dflock.client import Client
from celery_dflock.signals import lock_lost

from .common import record, record_lock_lost, settings_from_env, worker_app

app = worker_app("apps.lost_at_grant")
lock_lost.connect(record_lock_lost)

PREFIX = "grant:"
LOST_WAIT_S = 30.0
"""Longest the injected step waits for ``lock_lost`` (a test that fails still ends)."""

_told: dict[str, threading.Event] = {}


def _note_lost(sender: Any = None, key: str = "", **_: Any) -> None:
    _told.setdefault(key, threading.Event()).set()


lock_lost.connect(_note_lost, weak=False)

_mark_held = locked_run_module.mark_held


def _lose_then_mark_held(request: Any, key: str | None, lock: Any, options: Any) -> None:
    if key is not None and key.startswith(PREFIX):
        host, port = str(settings_from_env()["dflock_servers"]).rsplit(":", 1)
        operator = Client(servers=[(host, int(port))])
        try:
            freed = operator.force_release(key, note="test-fault")
        finally:
            operator.close()
        told = _told.setdefault(key, threading.Event()).wait(LOST_WAIT_S)
        record("lost_before_body", key=key, freed=freed, told=told, lost=lock.lost)
    _mark_held(request, key, lock, options)


locked_run_module.mark_held = _lose_then_mark_held


def _body(task: LockedTask, name: str) -> dict[str, Any]:
    lock = task.lock
    assert lock is not None
    try:
        record("body_started", name=name, lost=lock.lost)
        return {"lost": lock.lost}
    except LockLost as exc:
        record("interrupted", name=name, error=type(exc).__name__)
        raise


lossy = {"bind": True, "base": LockedTask, "lock_key": PREFIX + "{name}"}


@app.task(**lossy, on_lock_lost="interrupt")
def lost_at_grant_interrupt(self: LockedTask, name: str) -> dict[str, Any]:
    return _body(self, name)


@app.task(**lossy, on_lock_lost="flag")
def lost_at_grant_flag(self: LockedTask, name: str) -> dict[str, Any]:
    return _body(self, name)
