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

import tempfile
import threading
from typing import Any, Final, cast

from celery_dflock._celery import Signal, TimeLimitExceeded, WorkerLostError, get_logger
from celery_dflock._celery import signals as celery_signals
from celery_dflock._holds import HOLD_HEADER, HoldRef, hold_of
from celery_dflock._runtime import (
    CHILD_EXIT_WAIT_S,
    HeldRecords,
    get_runtime,
    pid_gone,
    reset_runtime_after_fork,
)
from celery_dflock.clients import leave_signals_to_the_main_thread
from celery_dflock.config import get_config
from celery_dflock.errors import DflockError

__all__ = ["install", "lock_lost", "lock_skipped"]

logger: Any = get_logger(__name__)

lock_lost: Final[Any] = Signal(name="lock_lost")
"""A running task's lock was lost (renewal refused, or its server unreachable)."""
lock_skipped: Final[Any] = Signal(name="lock_skipped")
"""A task run was skipped because its lock was busy (``on_locked="skip"``)."""

_HOOKS_ATTR: Final = "_dflock_hooks"


def _app_of(obj: Any) -> Any:
    """The app of a worker, consumer or task (None when it has none)."""
    return getattr(obj, "app", None) or getattr(obj, "_app", None)


class _Hooks:
    """The receivers for one app (kept on the app, so they live exactly as long)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.main_pid: int | None = None

    def connect(self) -> None:
        celery_signals.worker_init.connect(self.on_worker_init, weak=True)
        celery_signals.worker_ready.connect(self.on_worker_ready, weak=True)
        celery_signals.worker_process_init.connect(self.on_worker_process_init, weak=True)
        celery_signals.worker_process_shutdown.connect(self.on_worker_process_shutdown, weak=True)
        celery_signals.worker_shutdown.connect(self.on_worker_shutdown, weak=True)
        celery_signals.task_failure.connect(self.on_task_failure, weak=True)
        celery_signals.task_revoked.connect(self.on_task_revoked, weak=True)
        if getattr(self.app, "finalized", False):
            self._lock_configured_tasks()
        else:
            self.app.on_after_finalize.connect(self.on_after_finalize, weak=True)

    def _ours(self, sender: Any) -> bool:
        app = _app_of(sender)
        return app is None or app is self.app

    def _lock_configured_tasks(self) -> None:
        from celery_dflock.task import apply_task_locks

        apply_task_locks(self.app)

    # ---------------------------------------------------------------- receivers

    def on_after_finalize(self, sender: Any = None, **_: Any) -> None:
        if sender is self.app:
            self._lock_configured_tasks()

    def on_worker_init(self, sender: Any = None, **_: Any) -> None:
        if not self._ours(sender):
            return
        import os

        self._lock_configured_tasks()
        self.main_pid = os.getpid()
        runtime = get_runtime(self.app)
        runtime.records = HeldRecords.for_main_process(self.main_pid)
        threading.Thread(
            target=self._clean_up_after_dead_workers,
            name="dflock-leftovers",
            daemon=True,
        ).start()
        if runtime.records is None:
            logger.warning(
                "dflock: no private directory for held-lock records in %s; locks of killed "
                "pool children are freed by the server (auto-release) or their lease only",
                tempfile.gettempdir(),
            )

    def on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        """Config warnings, once the worker logs (it does not yet at ``worker_init``)."""
        if not self._ours(sender):
            return
        from celery_dflock.task import unknown_task_locks

        for warning in unknown_task_locks(self.app):
            logger.warning("dflock: %s", warning)
        # Asked from a thread: an unreachable server costs a connect timeout, which must not
        # hold up the worker.
        threading.Thread(
            target=self._report_servers, name="dflock-servers-check", daemon=True
        ).start()

    def _report_servers(self) -> None:
        """Log which lock servers this worker reaches; warn, naming ``dflock_servers``, about
        each one it cannot reach, and louder when it reaches none."""
        leave_signals_to_the_main_thread()
        try:
            with get_config(self.app).new_client() as client:
                answers = client.ping()
        except (DflockError, OSError) as exc:
            logger.warning("dflock: cannot ask the lock servers (dflock_servers): %s", exc)
            return
        reached = [a for a in answers if a.reachable]
        missed = [a for a in answers if not a.reachable]
        if reached:
            logger.info(
                "dflock: lock servers reached: %s",
                ", ".join(
                    f"{a.address} ({a.server.describe()})" if a.server else a.address
                    for a in reached
                ),
            )
        for answer in missed:
            logger.warning(
                "dflock: cannot reach lock server %s (dflock_servers): %s",
                answer.address,
                answer.error or "no answer",
            )
        limits = [a.server.max_lease_ttl_s for a in reached if a.server is not None]
        known = [limit for limit in limits if limit is not None]
        if known:
            from celery_dflock.task import leases_above

            for warning in leases_above(self.app, min(known)):
                logger.warning("dflock: %s", warning)
        if not reached:
            logger.warning(
                "dflock: this worker reaches none of its lock servers (dflock_servers = %s): "
                "no locked task can take its lock until one answers. Start the "
                "lock server (`dflockd`) or set dflock_servers to where it runs",
                ",".join(a.address for a in answers) or "(none)",
            )

    def on_worker_process_init(self, **_: Any) -> None:
        import os

        # Sent in each prefork child after the fork, and also by the solo pool in the worker's
        # own process: that one is no pool child (killing it would kill the worker).
        if self.main_pid is not None and self.main_pid == os.getpid():
            return
        reset_runtime_after_fork(self.app, in_pool_child=True)

    def on_worker_process_shutdown(self, **_: Any) -> None:
        get_runtime(self.app).close()

    def on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
        if not self._ours(sender):
            return
        runtime = get_runtime(self.app)
        if runtime.records is not None and self._in_main_process():
            self._release_orphans(None, wait_s=0)
            runtime.records.remove_all()
        runtime.close()

    def on_task_failure(
        self, sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any
    ) -> None:
        lost_child = isinstance(exception, WorkerLostError | TimeLimitExceeded)
        if lost_child and task_id and self._in_main_process() and self._ours(sender):
            self._release_orphans_soon(task_id)

    def on_task_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
    ) -> None:
        task_id = getattr(request, "id", None)
        if not self._ours(sender):
            return
        if terminated:
            if task_id and self._in_main_process():
                self._release_orphans_soon(task_id)
            return
        held = hold_of(_header_of(request, HOLD_HEADER))
        if held is not None:
            # Dropped before it ran: its publish-time hold has no run to end it.
            threading.Thread(
                target=self._release_hold,
                args=(held, task_id),
                name=f"dflock-revoked-{task_id}",
                daemon=True,
            ).start()

    def _release_hold(self, held: HoldRef, task_id: str | None) -> None:
        leave_signals_to_the_main_thread()
        try:
            released = (
                get_runtime(self.app).client(get_config(self.app)).release(held.key, held.token)
            )
        except (DflockError, OSError) as exc:
            logger.warning(
                "dflock: could not release key %r held for revoked task %s: %s "
                "(it frees after lock_pending_ttl)",
                held.key,
                task_id,
                exc,
            )
        else:
            if released:
                logger.info("dflock: released key %r of revoked task %s", held.key, task_id)

    # ---------------------------------------------------------------- orphan release

    def _clean_up_after_dead_workers(self) -> None:
        """Release what the pool children of dead workers recorded, and remove their records
        directories (a worker killed with -9 never removes its own)."""
        leave_signals_to_the_main_thread()
        if self.main_pid is None:
            return
        for records in HeldRecords.left_by_dead_workers(self.main_pid):
            self._release_from(records, None, wait_s=0)
            if not records.entries():
                records.remove_all()
                logger.info("dflock: removed %s, left by a worker that is gone", records.directory)

    def _in_main_process(self) -> bool:
        import os

        return self.main_pid == os.getpid()

    def _release_orphans_soon(self, task_id: str) -> None:
        # The consumer's thread must not block on a dying child: wait in a thread.
        threading.Thread(
            target=self._release_orphans_in_a_thread,
            args=(task_id,),
            name=f"dflock-orphan-{task_id}",
            daemon=True,
        ).start()

    def _release_orphans_in_a_thread(self, task_id: str) -> None:
        leave_signals_to_the_main_thread()
        self._release_orphans(task_id, CHILD_EXIT_WAIT_S)

    def _release_orphans(self, task_id: str | None, wait_s: float) -> None:
        records = get_runtime(self.app).records
        if records is not None:
            self._release_from(records, task_id, wait_s)

    def _release_from(self, records: HeldRecords, task_id: str | None, wait_s: float) -> None:
        runtime = get_runtime(self.app)
        config = get_config(self.app)
        for path, entry in records.entries(task_id):
            pid = int(entry.get("pid", 0))
            if pid and not pid_gone(pid, wait_s):
                # Still alive: it is running or unwinding the task and releases it itself.
                logger.info(
                    "dflock: pool child %s still runs task %s; it releases %r itself",
                    pid,
                    task_id,
                    entry.get("key"),
                )
                continue
            try:
                released = runtime.release_token(
                    config, str(entry["key"]), str(entry["token"]), entry.get("limit")
                )
            except (DflockError, OSError, KeyError) as exc:
                logger.warning(
                    "dflock: could not release %r left by dead pool child %s: %s "
                    "(its lease will expire)",
                    entry.get("key"),
                    pid,
                    exc,
                )
            else:
                if released:
                    logger.info(
                        "dflock: released %r left by dead pool child %s", entry.get("key"), pid
                    )
            records.forget(path, entry)


def _header_of(request: Any, name: str) -> object:
    """A message header of a worker request (an attribute, or an entry of its headers)."""
    value: object = getattr(request, name, None)
    if value is None:
        headers: object = getattr(request, "headers", None)
        if isinstance(headers, dict):
            value = cast("dict[str, object]", headers).get(name)
    return value


def install(app: Any) -> None:
    """Connect the worker hooks for ``app`` (idempotent; see the module docstring)."""
    if isinstance(getattr(app, _HOOKS_ATTR, None), _Hooks):
        return
    hooks = _Hooks(app)
    setattr(app, _HOOKS_ATTR, hooks)
    hooks.connect()
