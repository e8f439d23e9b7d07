"""Signals sent by locked tasks, and the worker hooks that keep locks honest.

Signals (``celery.utils.dispatch.Signal``, connect as with Celery's own):

* `lock_lost` (sent from the renewal thread) -- ``sender``: the task; keyword arguments
  ``task_id``, ``key``, ``lock`` (the client lock, ``lock.fence`` its fencing token) and
  ``policy`` (the ``on_lock_lost`` applied).
* `lock_skipped` (a run dropped by ``on_locked="skip"``) -- ``sender``: the task;
  ``task_id``, ``key``, ``args``, ``kwargs``, ``holder`` (the holder's task id; None: it left none).

`install` connects the worker hooks for one app. A ``LockedTask`` calls it when it is bound to
an app, so only an app that locks tasks through ``dflock_task_locks`` alone calls
``celery_dflock.signals.install(app)`` (once). The hooks:

* ``worker_init`` (main process): lock the tasks named in ``dflock_task_locks``.
* ``worker_ready`` (once the worker logs): clean up the held-lock records of workers that died
  without doing so; warn about ``dflock_task_locks`` entries that name no task, a broker's
  ``visibility_timeout`` (Redis, SQS) not above a retry's countdown, lock servers the worker
  cannot reach, and leases above the longest the servers grant.
* ``task_received``: count a message sent again for a lock-server outage, and watch the
  servers until they answer.
* ``worker_process_init`` / ``worker_process_shutdown`` / ``worker_shutdown``: a fresh client in
  each prefork child; close it.
* ``task_failure`` with ``WorkerLostError`` or a hard ``TimeLimitExceeded``, ``task_revoked``
  with ``terminated=True``: release what the child that ran the task held, once it has exited.
* ``task_revoked`` without ``terminated`` (a message dropped before it runs): release the
  publish-time hold it names, so its key is free at once.
"""

from __future__ import annotations

from typing import Any

from celery_dflock._run import lock_lost, lock_skipped
from celery_dflock._worker_hooks import install_hooks
from celery_dflock.task import LockedTask

__all__ = ["install", "lock_lost", "lock_skipped"]


def install(app: Any) -> None:
    """Connect the worker hooks for ``app`` (idempotent; see the module docstring)."""
    install_hooks(app, LockedTask)
