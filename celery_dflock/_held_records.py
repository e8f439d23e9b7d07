"""Where prefork pool children record the locks they hold, so the worker's main process can
release them when a child dies under a task.

* :class:`HeldRecords` -- the directory where pool children record the locks
  they hold. Each child keeps one file (:class:`HeldWriter`) listing what it
  holds now (task id, key, token, its pid), rewritten in place when a lock is
  taken or released. The worker's main process reads it when a child died
  under a task (hard time limit, revoke with terminate, SIGKILL): once the
  child is gone, it releases the token. The server normally released it
  already when the child's socket closed; this covers servers with
  auto-release turned off. Release is idempotent.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

from celery_dflock.client import DistributedLock, DistributedSemaphore

__all__ = ["CHILD_EXIT_WAIT_S", "AnyLock", "HeldRecord", "HeldRecords", "HeldWriter", "pid_gone"]

_RECORD_SUFFIX: Final = ".held"
_PARTIAL_SUFFIX: Final = ".tmp"
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
    """The directory of files ``<pid>.held`` naming the locks pool children hold.

    A file holds a JSON list of ``{"task_id", "key", "token", "limit", "pid"}`` (padded with
    spaces, see `HeldWriter`). Only its child writes it while the child lives; the main
    process reads it, and edits it only once the child is gone.
    """

    directory: Path
    _edits: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

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

    @classmethod
    def left_by_dead_workers(cls, pid: int) -> list[HeldRecords]:
        """The records directories of worker main processes that are gone (killed with -9,
        say, so they never removed theirs), besides the one of live worker ``pid``."""
        prefix = f"celery-dflock-{os.getuid()}-"
        found: list[HeldRecords] = []
        for path in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
            owner = path.name.removeprefix(prefix)
            if not owner.isdigit() or int(owner) == pid or not pid_gone(int(owner), 0):
                continue
            try:
                info = path.lstat()
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
                found.append(cls(path))
        return found

    def writer(self) -> HeldWriter:
        """A record file for this process (keep one per process: see `Runtime.held_writer`)."""
        return HeldWriter(self.directory)

    @staticmethod
    def _read(path: Path) -> list[dict[str, Any]]:
        try:
            found: object = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return []  # gone, or being written by a child that is alive (it is skipped)
        if not isinstance(found, list):
            return []
        items = cast("list[object]", found)
        return [cast("dict[str, Any]", e) for e in items if isinstance(e, dict)]

    def entries(self, task_id: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
        """(file, entry) of every recorded lock (of ``task_id`` only, when given)."""
        found: list[tuple[Path, dict[str, Any]]] = []
        for path in sorted(self.directory.glob(f"*{_RECORD_SUFFIX}")):
            for entry in self._read(path):
                if task_id is None or entry.get("task_id") == task_id:
                    found.append((path, entry))
        return found

    def forget(self, path: Path, entry: dict[str, Any]) -> None:
        """Drop ``entry`` from ``path`` (main process, once the child that wrote it is gone)."""
        with self._edits:
            rest = [e for e in self._read(path) if e != entry]
            with contextlib.suppress(OSError):
                if not rest:
                    path.unlink()
                    return
                tmp = path.with_suffix(_PARTIAL_SUFFIX)
                tmp.write_bytes(json.dumps(rest).encode())
                tmp.replace(path)

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class HeldRecord:
    """One recorded lock (`HeldWriter.add`); `remove` it when the lock is released."""

    __slots__ = ("_handle", "_writer")

    def __init__(self, writer: HeldWriter, handle: int) -> None:
        self._writer = writer
        self._handle = handle

    def remove(self) -> None:
        """Take this lock out of the record file (idempotent)."""
        self._writer.remove(self._handle)


class HeldWriter:
    """This process's record file ``<directory>/<pid>.held``: what it holds right now.

    Every change rewrites the whole list with one ``pwrite`` at offset 0 on a file kept open,
    padded with spaces to at least the length written before, so the file never ends in
    leftovers of a longer list and the main process never needs a rename to read it whole
    (it reads a child's file only once that child is gone). This runs around every locked run
    in a pool child: two small writes, no files created or renamed per run.
    """

    def __init__(self, directory: Path) -> None:
        self.pid = os.getpid()
        self.path = f"{directory}{os.sep}{self.pid}{_RECORD_SUFFIX}"
        self._guard = threading.Lock()
        self._held: dict[int, str] = {}  # handle -> the entry as JSON
        self._next = 0
        self._fd: int | None = None
        self._size = 0

    def add(self, task_id: str, lock: AnyLock, limit: int | None) -> HeldRecord | None:
        """Record that this process holds ``lock`` for ``task_id`` (None if it could not)."""
        entry = json.dumps(
            {
                "task_id": task_id,
                "key": lock.key,
                "token": lock.token,
                "limit": limit,
                "pid": self.pid,
            }
        )
        with self._guard:
            self._next += 1
            handle = self._next
            self._held[handle] = entry
            if not self._write():
                del self._held[handle]
                return None  # the main process is gone or the directory removed
        return HeldRecord(self, handle)

    def remove(self, handle: int) -> None:
        with self._guard:
            if self._held.pop(handle, None) is not None:
                self._write()

    def _write(self) -> bool:
        data = f"[{', '.join(self._held.values())}]".encode()
        if len(data) < self._size:
            data = data.ljust(self._size)  # JSON allows trailing whitespace
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
