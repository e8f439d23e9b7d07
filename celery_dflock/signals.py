"""Signals sent by locked tasks, and the worker hooks that keep locks honest.

Signals (``celery.utils.dispatch.Signal``, connect as with Celery's own):

* :data:`lock_lost` -- ``sender`` is the task; keyword arguments ``task_id``,
  ``key``, ``lock`` (the client lock, ``lock.fence`` its fencing token) and
  ``policy`` (the ``on_lock_lost`` applied). Sent from the renewal thread.
* :data:`lock_skipped` -- ``sender`` is the task; ``task_id``, ``key``,
  ``args``, ``kwargs``, ``holder`` (the task id holding the key, or None when it
  left none): a run was dropped by ``on_locked="skip"``.

:func:`install` connects the worker hooks for one app. ``LockedTask`` calls it
when it is bound to an app, so an app using ``LockedTask`` needs nothing
more; an app that locks tasks only through ``dflock_task_locks`` calls
``celery_dflock.signals.install(app)`` once. The hooks:

* ``worker_init`` (main process): lock the tasks named in ``dflock_task_locks``; clean up the
  held-lock records of workers that died without doing so.
* ``worker_ready``: warn about ``dflock_task_locks`` entries that name no task; log which lock
  servers the worker reaches, and warn (naming ``dflock_servers``) about those it cannot, and
  about tasks whose lease is above the longest the servers grant (their ``hello`` says).
* ``worker_process_init`` (each prefork child, after fork): a fresh connection
  pool for the child.
* ``worker_process_shutdown`` / ``worker_shutdown``: close the pool.
* ``task_failure`` with ``WorkerLostError`` or a hard ``TimeLimitExceeded``,
  and ``task_revoked`` with ``terminated=True`` (all in the main process):
  once the child that ran the task has exited, release what it held.
* ``task_revoked`` without ``terminated`` (a revoked or expired message the worker
  drops before it runs): release the publish-time hold the message names
  (``lock_from="publish"``), so its key is free at once.
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
