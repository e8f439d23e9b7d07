"""Per-process state of the Celery integration, kept on the app (never at module level).

:class:`Runtime` -- one per process and app: the app's `Client` and its connection pool (made
after fork, closed at shutdown), whether this process is a prefork pool child, where held
locks are recorded (`celery_dflock._held_records`), and what the runs of each task reuse
(`celery_dflock._plan.TaskRuns`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from celery_dflock._held_records import AnyLock, HeldRecords, HeldWriter
from celery_dflock._plan import LockOptions, TaskRuns
from celery_dflock.client.clients import Client
from celery_dflock.config import DflockConfig

__all__ = ["AnyLock", "Runtime", "get_runtime", "reset_runtime_after_fork"]

_RUNTIME_ATTR: Final = "_dflock_runtime"


@dataclass
class Runtime:
    """What one process needs to lock tasks of one app: the app's `Client` (made in this
    process, so a pool child never shares its parent's pool), and the held-lock records."""

    pid: int = field(default_factory=os.getpid)
    in_pool_child: bool = False
    records: HeldRecords | None = None
    _client: tuple[DflockConfig, Client] | None = None
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _held_writer: HeldWriter | None = None
    _task_runs: dict[str, TaskRuns] = field(default_factory=dict[str, TaskRuns])

    def task_runs(self, name: str) -> TaskRuns:
        """What the runs of task ``name`` reuse in this process (its plan, its key builder)."""
        runs = self._task_runs.get(name)
        if runs is None:
            runs = self._task_runs.setdefault(name, TaskRuns())
        return runs

    def held_writer(self) -> HeldWriter | None:
        """This process's record file, when held locks are recorded (see `HeldRecords`)."""
        writer = self._held_writer
        if writer is None and self.records is not None:
            with self._guard:
                if self._held_writer is None:
                    self._held_writer = self.records.writer()
                writer = self._held_writer
        return writer

    def client(self, config: DflockConfig) -> Client:
        """The app's `Client` in this process (a new one when the settings were re-read)."""
        made = self._client
        if made is not None and made[0] is config:
            return made[1]
        with self._guard:
            made = self._client
            if made is None or made[0] is not config:
                if made is not None:
                    made[1].close()
                made = self._client = (config, config.new_client())
                # Close idle connections when this runtime (its app) goes away.
                weakref.finalize(self, made[1].close)
            return made[1]

    def new_lock(
        self,
        config: DflockConfig,
        key: str,
        options: LockOptions,
        *,
        acquire_timeout_s: float,
        on_lost: Callable[[Any], None] | None,
        note: str | None = None,
    ) -> AnyLock:
        """An unacquired lock (or semaphore, with ``lock_limit``) on ``key``; a lock carries
        the owner ``note`` (a semaphore none)."""
        client = self.client(config)
        if options.limit is not None:
            return client.semaphore(
                key,
                options.limit,
                acquire_timeout_s=acquire_timeout_s,
                lease_ttl_s=options.ttl,
                on_lost=on_lost,
            )
        return client.lock(
            key,
            acquire_timeout_s=acquire_timeout_s,
            lease_ttl_s=options.ttl,
            on_lost=on_lost,
            note=note,
        )

    def release_token(self, config: DflockConfig, key: str, token: str, limit: int | None) -> bool:
        """Release ``token`` on ``key`` for a process that cannot (idempotent).

        True if the server released it; False if it no longer held it.
        """
        return self.client(config).release(key, token, limit=limit)

    def close(self) -> None:
        with self._guard:
            made, self._client = self._client, None
            writer, self._held_writer = self._held_writer, None
        if made is not None:
            made[1].close()
        if writer is not None:
            writer.close()


def get_runtime(app: object) -> Runtime:
    """This process's :class:`Runtime` for ``app`` (a fresh one after a fork)."""
    runtime = getattr(app, _RUNTIME_ATTR, None)
    if isinstance(runtime, Runtime) and runtime.pid == os.getpid():
        return runtime
    fresh = Runtime(records=runtime.records if isinstance(runtime, Runtime) else None)
    setattr(app, _RUNTIME_ATTR, fresh)
    return fresh


def reset_runtime_after_fork(app: object, *, in_pool_child: bool) -> Runtime:
    """Replace the inherited runtime in a new pool child (the parent's pool is not ours)."""
    inherited = getattr(app, _RUNTIME_ATTR, None)
    fresh = Runtime(
        in_pool_child=in_pool_child,
        records=inherited.records if isinstance(inherited, Runtime) else None,
    )
    setattr(app, _RUNTIME_ATTR, fresh)
    return fresh
