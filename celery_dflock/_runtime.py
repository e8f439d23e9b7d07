"""Per-process state of the Celery integration, kept on the app (never at module level).

`Runtime` -- one per process and app: the app's `Client` (made after fork, so a pool
child never shares its parent's), whether this process is a prefork pool child, what the runs
of each task reuse (`TaskRuns`: whether they are locked, their options and `KeyBuilder`,
worked out once while the config and every lock attribute stay the same objects), and where
held locks are recorded.

The held-lock records (`HeldRecords`): each prefork pool child keeps one file (`HeldWriter`)
listing the locks it holds now, so the worker's main process can release them as soon as the
child dies under a task (hard time limit, revoke with terminate, SIGKILL), rather than when
the server ends the dead child's client session (``dflock_session_ttl`` later, or at the lease's
end).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import select
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from operator import is_
from pathlib import Path
from types import MethodType
from typing import Any, Final, cast

from celery_dflock._settings import LOCK_OPTIONS, GivenOptions, read_attributes
from celery_dflock.client import DistributedLock, DistributedSemaphore
from celery_dflock.client.clients import Client
from celery_dflock.config import DflockConfig, LockOptions, get_config, resolve_options
from celery_dflock.keys import KeyBuilder


def _same(a: object, b: object) -> bool:
    """The same object, or the same bound method (a new object at every attribute access)."""
    return a is b or (type(a) is MethodType and a == b)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Whether runs of a task without call options are locked, and their options, as worked
    out from these inputs."""

    config: DflockConfig
    attributes: tuple[object, ...]
    given: GivenOptions
    """The task's lock attributes, checked."""
    options: LockOptions | None
    """None: runs without call options are not locked."""

    def fits(self, config: DflockConfig, attributes: tuple[object, ...]) -> bool:
        # The same config, and each attribute the same object: the usual case, compared in C;
        # else each by `_same`.
        return self.config is config and (
            all(map(is_, self.attributes, attributes))
            or all(_same(a, b) for a, b in zip(self.attributes, attributes, strict=True))
        )


@dataclass(slots=True)
class TaskRuns:
    """A task's plan and key builder in one process (kept by the `Runtime`)."""

    plan: _Plan | None = None
    keys: KeyBuilder | None = None

    def plan_for(self, task: Any, config: DflockConfig, attributes: tuple[object, ...]) -> _Plan:
        """Locked or not, and the options, for a run without call options."""
        plan = self.plan
        if plan is not None and plan.fits(config, attributes):
            return plan
        name = str(task.name)
        bound: tuple[tuple[object, ...], GivenOptions] | None = getattr(task, _CHECKED_ATTR, None)
        if bound is not None and all(map(is_, bound[0], attributes)):
            given = bound[1]
        else:  # changed since the bind (or never bound): they enter here
            given = _read(attributes, name)
        # Locked with a lock option, a dflock_task_locks entry, or base=LockedTask named (not
        # inherited only through the app's task_cls); with call options, always.
        locked = (
            name in config.task_locks
            or any(value is not None for value in attributes)
            or not isinstance(task, task._get_app().Task)
        )
        options = resolve_options(config, name, given, None) if locked else None
        plan = self.plan = _Plan(config, attributes, given, options)
        return plan

    def key_builder(
        self, task: Any, source: object, run: Callable[..., Any], prefix: str
    ) -> KeyBuilder:
        """The `KeyBuilder` for the task's runs (its signature is inspected once)."""
        keys = self.keys
        if (
            keys is None
            or keys.prefix != prefix
            or not (_same(keys.source, source) and _same(keys.run, run))
        ):
            keys = KeyBuilder(cast("Any", source), task_name=str(task.name), run=run, prefix=prefix)
            self.keys = keys
        return keys


_CHECKED_ATTR: Final = "_dflock_checked_attributes"


_LOCK_ATTRIBUTES: Final = operator.attrgetter(*LOCK_OPTIONS)


def _attributes(task: object) -> tuple[object, ...]:
    """The lock attributes of a task or task class, in `LOCK_OPTIONS`' order (a LockedTask has
    them all: one C call; another task, those it has)."""
    try:
        return cast("tuple[object, ...]", _LOCK_ATTRIBUTES(task))
    except AttributeError:
        return tuple([getattr(task, option, None) for option in LOCK_OPTIONS])


def _read(attributes: tuple[object, ...], name: str) -> GivenOptions:
    """Task ``name``'s lock ``attributes`` (`_attributes`), checked."""
    return read_attributes(dict(zip(LOCK_OPTIONS, attributes, strict=True)), name)


def check_attributes(task_cls: type[Any], name: str) -> None:
    """Check the lock attributes a task class is bound with, and keep them for its runs."""
    attributes = _attributes(task_cls)
    setattr(task_cls, _CHECKED_ATTR, (attributes, _read(attributes, name)))


def options_for(
    task: Any,
    config: DflockConfig,
    runs: TaskRuns,
    per_call: GivenOptions | None,
    beat: GivenOptions | None = None,
) -> LockOptions | None:
    """The lock options of a run (or a publish) of ``task``; None when it is not locked
    (``per_call``, ``beat``: the options its message gives, already checked)."""
    plan = runs.plan_for(task, config, _attributes(task))
    if per_call is not None or beat is not None:  # resolved every time (they must count)
        return resolve_options(config, str(task.name), plan.given, per_call, beat)
    return plan.options


_RECORD_SUFFIX: Final = ".held"
_PARTIAL_SUFFIX: Final = ".tmp"
CHILD_EXIT_WAIT_S: Final = 10.0  # waited for a lost child to exit before its locks are released

AnyLock = DistributedLock | DistributedSemaphore
Servers = tuple[tuple[str, int], ...]


def pid_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for process ``pid`` to exit; True if it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):  # no pidfd_open (not Linux >= 5.3): poll
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
    try:
        return bool(select.select([fd], [], [], timeout)[0])  # readable once it has exited
    finally:
        os.close(fd)


@dataclass(frozen=True)
class HeldRecords:
    """The directory of files ``<pid>.held``, each a JSON list of ``{"task_id", "key",
    "token", "limit", "pid"}`` (space-padded, see `HeldWriter`). Only its child writes a file
    while the child lives; the main process reads it, and edits it once the child is gone."""

    directory: Path
    _edits: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @staticmethod
    def _prefix(servers: Servers) -> str:
        """The name of the records directories of workers on ``servers`` (as ordered: that
        routes the keys), less their pid."""
        digest = hashlib.blake2b(repr(servers).encode(), digest_size=4).hexdigest()
        return f"celery-dflock-{os.getuid()}-{digest}-"

    @classmethod
    def for_main_process(cls, pid: int, servers: Servers) -> HeldRecords | None:
        """The records directory of worker main process ``pid`` on lock ``servers``; None unless
        it is ours and private (tokens are bearer credentials)."""
        directory = Path(tempfile.gettempdir()) / f"{cls._prefix(servers)}{pid}"
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            info = directory.lstat()
        except OSError:
            return None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        return cls(directory)

    @classmethod
    def left_by_dead_workers(cls, pid: int, servers: Servers) -> list[HeldRecords]:
        """The records directories of gone worker main processes (killed with -9, say) on lock
        ``servers``: only they can release what those hold."""
        return [cls(path) for path in _left_by_gone(cls._prefix(servers), pid)]

    @classmethod
    def left_by_earlier_versions(cls) -> list[HeldRecords]:
        """Records directories of the naming without servers (``celery-dflock-<uid>-<pid>``)
        whose worker and every pool child that wrote in them are gone: their servers unknown
        (what they record ends with its sessions), they are only to be removed."""
        found: list[HeldRecords] = []
        for path in _left_by_gone(f"celery-dflock-{os.getuid()}-"):
            try:
                writers = [name.partition(".")[0] for name in os.listdir(path)]
            except OSError:
                continue
            if all(pid.isdigit() and pid_gone(int(pid), 0) for pid in writers):
                found.append(cls(path))
        return found

    @staticmethod
    def _read(path: Path) -> list[dict[str, Any]]:
        try:
            found: object = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return []  # gone, or being written by a child that is alive (it is skipped)
        items = cast("list[object]", found) if isinstance(found, list) else []
        return [cast("dict[str, Any]", e) for e in items if isinstance(e, dict)]

    def entries(self, task_id: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
        """(file, entry) of every recorded lock (of ``task_id`` only, when given)."""
        found: list[tuple[Path, dict[str, Any]]] = []
        for path in sorted(self.directory.glob(f"*{_RECORD_SUFFIX}")):
            for entry in self._read(path):
                if task_id is None or entry.get("task_id") == task_id:
                    found.append((path, entry))
        return found

    def forget(self, path: Path, entry: dict[str, Any]) -> bool:
        """Drop ``entry`` from ``path`` (main process, once the child that wrote it is gone);
        False when it was gone already (another clean-up took it)."""
        with self._edits:
            found = self._read(path)
            rest = [e for e in found if e != entry]
            with contextlib.suppress(OSError):
                if not rest:
                    path.unlink()
                else:
                    tmp = path.with_suffix(_PARTIAL_SUFFIX)
                    tmp.write_bytes(json.dumps(rest).encode())
                    tmp.replace(path)
            return len(rest) < len(found)

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _left_by_gone(prefix: str, pid: int | None = None) -> Iterator[Path]:
    """This user's directories ``<prefix><pid>`` in the temporary directory whose process is
    gone (``pid``'s own passed over)."""
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        owner = path.name.removeprefix(prefix)
        if not owner.isdigit() or int(owner) == pid or not pid_gone(int(owner), 0):
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            yield path


class HeldWriter:
    """This process's record file ``<directory>/<pid>.held``: what it holds right now.

    Every change rewrites the whole list with one ``pwrite`` at offset 0 on a file kept open,
    space-padded to the longest length written, so no rename is needed (the main process reads
    it only once the child is gone): two small writes per locked run."""

    def __init__(self, directory: Path) -> None:
        self.pid = os.getpid()
        self.path = f"{directory}{os.sep}{self.pid}{_RECORD_SUFFIX}"
        self._guard = threading.Lock()
        self._held: dict[int, str] = {}  # handle -> the entry as JSON
        self._next = 0
        self._fd: int | None = None
        self._size = 0

    def add(self, task_id: str, lock: AnyLock, limit: int | None) -> Callable[[], None] | None:
        """Record that this process holds ``lock`` for ``task_id``; what takes the record out
        again (idempotent), or None if it could not be written."""
        entry = json.dumps({
            "task_id": task_id, "key": lock.key, "token": lock.token, "limit": limit,
            "pid": self.pid,
        })  # fmt: skip
        with self._guard:
            self._next += 1
            handle = self._next
            self._held[handle] = entry
            if not self._write():
                del self._held[handle]
                return None  # the main process is gone or the directory removed
        return partial(self.remove, handle)

    def remove(self, handle: int) -> None:
        with self._guard:
            if self._held.pop(handle, None) is not None:
                self._write()

    def _write(self) -> bool:
        # Padded to the longest length written (JSON allows trailing whitespace).
        data = f"[{', '.join(self._held.values())}]".encode().ljust(self._size)
        try:
            if self._fd is None:
                # O_TRUNC: a file left by an earlier process with this pid is not ours.
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            done = 0
            while done < len(data):
                done += os.pwrite(self._fd, data[done:], done)
        except OSError:
            return False
        self._size = max(self._size, len(data))
        return True

    def close(self) -> None:
        """Close the file; remove it when nothing is recorded in it."""
        with self._guard:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            with contextlib.suppress(OSError):
                os.close(fd)
            if not self._held:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)


_RUNTIME_ATTR: Final = "_dflock_runtime"


@dataclass
class Runtime:
    """What one process needs to lock tasks of one app (see the module docstring)."""

    pid: int = field(default_factory=os.getpid)
    in_pool_child: bool = False
    records: HeldRecords | None = None
    worker_time_limits: tuple[float | None, float | None] = (None, None)
    """The worker's own hard and soft time limits (``--time-limit``, ``--soft-time-limit`` or
    the app's settings): its pool's defaults, set at ``worker_init``."""
    _client: tuple[DflockConfig, Client] | None = None
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _held_writer: HeldWriter | None = None
    _task_runs: dict[str, TaskRuns] = field(default_factory=dict[str, TaskRuns])

    def task_runs(self, name: str) -> TaskRuns:
        """What the runs of task ``name`` reuse in this process (its plan, its key builder)."""
        return self._task_runs.get(name) or self._task_runs.setdefault(name, TaskRuns())

    def held_writer(self) -> HeldWriter | None:
        """This process's record file (one per process), when held locks are recorded (see
        `HeldRecords`)."""
        writer = self._held_writer
        if writer is None and self.records is not None:
            with self._guard:
                if self._held_writer is None:
                    self._held_writer = HeldWriter(self.records.directory)
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

    def close(self) -> None:
        with self._guard:
            made, self._client = self._client, None
            writer, self._held_writer = self._held_writer, None
        if made is not None:
            made[1].close()
        if writer is not None:
            writer.close()


def get_runtime(app: object) -> Runtime:
    """This process's `Runtime` for ``app`` (a fresh one after a fork)."""
    runtime = getattr(app, _RUNTIME_ATTR, None)
    if isinstance(runtime, Runtime) and runtime.pid == os.getpid():
        return runtime
    return reset_runtime_after_fork(app, in_pool_child=False)


def app_client(app: Any) -> Client:
    """The app's `Client` in this process (`Runtime.client`)."""
    return get_runtime(app).client(get_config(app))


def reset_runtime_after_fork(app: object, *, in_pool_child: bool) -> Runtime:
    """Replace the inherited runtime in a new pool child (the parent's pool is not ours)."""
    fresh = Runtime(in_pool_child=in_pool_child)
    if isinstance(inherited := getattr(app, _RUNTIME_ATTR, None), Runtime):
        fresh.records = inherited.records
        fresh.worker_time_limits = inherited.worker_time_limits
    setattr(app, _RUNTIME_ATTR, fresh)
    return fresh
