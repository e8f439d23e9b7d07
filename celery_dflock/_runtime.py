"""Per-process state of the Celery integration, kept on the app (never at module level).

* :class:`Runtime` -- one per process and app: the connection pool (made after
  fork, closed at shutdown), whether this process is a prefork pool child, and
  the directory where held locks are recorded.
* :class:`HeldRecords` -- a pool child writes one small JSON file per held lock
  (key, token, its pid) and removes it on release. The worker's main process
  reads it when a child died under a task (hard time limit, revoke with
  terminate, SIGKILL): once the child is gone, it releases the token. The
  server normally released it already when the child's socket closed; this
  covers servers with auto-release turned off. Release is idempotent.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

from celery_dflock import protocol
from celery_dflock._connection import Connection
from celery_dflock._core import Endpoint
from celery_dflock.client import DistributedLock, DistributedSemaphore
from celery_dflock.config import DflockConfig, LockOptions
from celery_dflock.pool import ConnectionPool
from celery_dflock.protocol import Command

__all__ = ["HeldRecords", "Runtime", "get_runtime", "pid_gone"]

_RUNTIME_ATTR: Final = "_dflock_runtime"
_RECORD_SUFFIX: Final = ".json"
_PARTIAL_SUFFIX: Final = ".tmp"
_UNSAFE_STEM: Final = re.compile(r"[^\w-]")
CHILD_EXIT_WAIT_S: Final = 10.0
"""How long the main process waits for a child to exit before it releases the child's lock."""

AnyLock = DistributedLock | DistributedSemaphore


def pid_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for process ``pid`` to exit; True if it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):
        return _pid_gone_polling(pid, timeout)
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def _pid_gone_polling(pid: int, timeout: float) -> bool:
    # Fallback where pidfd_open is missing (not Linux >= 5.3).
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@dataclass(frozen=True)
class HeldRecords:
    """Files ``<task id>.<pid>.json`` naming the locks pool children hold (see module doc)."""

    directory: Path

    @classmethod
    def for_main_process(cls, pid: int) -> HeldRecords | None:
        """The records directory of worker main process ``pid`` (None if it is unsafe).

        Tokens are bearer credentials: the directory must be ours and private.
        """
        directory = Path(tempfile.gettempdir()) / f"celery-dflock-{os.getuid()}-{pid}"
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            info = directory.lstat()
        except OSError:
            return None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        return cls(directory)

    @staticmethod
    def _stem(task_id: str) -> str:
        # Every character but letters, digits, "-" and "_" (str.isalnum's letters and
        # digits: what \w means in a str pattern) becomes "_".
        return _UNSAFE_STEM.sub("_", task_id)

    def add(self, task_id: str, lock: AnyLock, limit: int | None) -> str | None:
        """Record that this process holds ``lock`` for ``task_id``; the record's path.

        Written beside its final name and renamed into place, so a reader never sees half a
        record. Plain ``os`` calls: this runs for every locked run in a pool child.
        """
        pid = os.getpid()
        entry = {"key": lock.key, "token": lock.token, "limit": limit, "pid": pid}
        data = json.dumps(entry).encode()
        base = f"{self.directory}{os.sep}{self._stem(task_id)}.{pid}"
        path = base + _RECORD_SUFFIX
        tmp = base + _PARTIAL_SUFFIX
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            return None  # the main process is gone or the directory removed: nothing to do
        return path

    @staticmethod
    def remove(path: str | Path | None) -> None:
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def entries(self, task_id: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
        pattern = f"*{_RECORD_SUFFIX}"
        if task_id is not None:
            pattern = f"{self._stem(task_id)}.*{_RECORD_SUFFIX}"
        found: list[tuple[Path, dict[str, Any]]] = []
        for path in sorted(self.directory.glob(pattern)):
            try:
                found.append((path, cast("dict[str, Any]", json.loads(path.read_text()))))
            except (OSError, ValueError):
                continue
        return found

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class Runtime:
    """What one process needs to lock tasks of one app."""

    pid: int = field(default_factory=os.getpid)
    in_pool_child: bool = False
    records: HeldRecords | None = None
    _pool: ConnectionPool | None = None
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _lock_settings: tuple[DflockConfig, dict[str, Any]] | None = None

    def pool(self) -> ConnectionPool:
        with self._guard:
            if self._pool is None:
                self._pool = ConnectionPool()
                # Close idle connections when this runtime (its app) goes away.
                weakref.finalize(self, self._pool.close)
            return self._pool

    def new_lock(
        self,
        config: DflockConfig,
        key: str,
        options: LockOptions,
        *,
        acquire_timeout_s: float,
        on_lost: Callable[[Any], None] | None,
    ) -> AnyLock:
        """An unacquired lock (or semaphore, with ``lock_limit``) on ``key``."""
        settings = self._lock_settings
        if settings is None or settings[0] is not config:
            # What every lock of this config and process shares, gathered once.
            shared: dict[str, Any] = {
                "servers": config.servers,
                "renew_ratio": config.renew_ratio,
                "auth_token": config.auth_token,
                "ssl_context": config.ssl_context,
                "connect_timeout_s": config.connect_timeout_s,
            }
            if config.sharding_strategy is not None:
                shared["sharding_strategy"] = config.sharding_strategy
            settings = self._lock_settings = (config, shared)
        common = settings[1]
        pool = self.pool()
        if options.limit is not None:
            return DistributedSemaphore(
                key,
                options.limit,
                acquire_timeout_s=acquire_timeout_s,
                lease_ttl_s=options.ttl,
                on_lost=on_lost,
                pool=pool,
                **common,
            )
        return DistributedLock(
            key,
            acquire_timeout_s=acquire_timeout_s,
            lease_ttl_s=options.ttl,
            on_lost=on_lost,
            pool=pool,
            **common,
        )

    def release_token(self, config: DflockConfig, key: str, token: str, limit: int | None) -> bool:
        """Release ``token`` on ``key`` for a process that cannot (idempotent).

        True if the server released it; False if it no longer held it.
        """
        # A lock object works out which server the key is routed to.
        options = LockOptions(
            key=None,
            timeout=0,
            ttl=None,
            on_locked="raise",
            limit=limit,
            on_lock_lost="flag",
            retry_countdown=0,
            retry_backoff_max=0,
            retry_jitter=False,
        )
        host, port = self.new_lock(config, key, options, acquire_timeout_s=0, on_lost=None).server
        endpoint = Endpoint(
            host, port, config.auth_token, config.ssl_context, config.connect_timeout_s
        )
        if limit is None:
            command, data = Command.RELEASE, protocol.encode_release(key, token)
        else:
            command, data = Command.SEM_RELEASE, protocol.encode_sem_release(key, token)
        conn = Connection.open(endpoint)
        try:
            return isinstance(conn.request(command, data), protocol.Ok)
        finally:
            conn.close()

    def close(self) -> None:
        with self._guard:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


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
