"""Fencing tokens: a strictly increasing 64-bit counter plus a random suffix.

The counter starts at the wall clock in nanoseconds (so it keeps increasing across restarts
even without a state file: no server hands out a billion grants per second) and, when a ceiling
store is configured, never below the ceiling persisted there. The store records a ceiling
``FENCE_PERSIST_BLOCK`` grants ahead of the counter; it is rewritten only when the counter
reaches it, not on every grant, and always before any counter at or above the old ceiling is
issued (a failed write issues nothing).

Stores: a file (``--fence-state-file``, rewritten atomically) or, in cluster mode, an etcd key
(``cluster.fencestore``), where the ceiling is also what the next owner of a shard reads to
raise its own counter above everything this member issued (``raise_to``).

``next_token`` runs on the server's loop; ``raise_to`` may come from a cluster member's thread,
so both hold the counter's lock.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Protocol

from dflockd_server import constants as c

_SUFFIX_BYTES = 8
_CHUNK_BYTES = 4096


class FenceStateError(OSError):
    """The fence state file cannot be read or written."""


def read_ceiling(path: str) -> int:
    """The ceiling persisted at ``path`` (0 when the file does not exist)."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as exc:
        raise FenceStateError(f"cannot read fence state file {path!r}: {exc}") from exc
    if not text.isdigit():
        raise FenceStateError(
            f"fence state file {path!r} does not hold a decimal counter (found {text[:40]!r}); "
            "fix or remove it"
        )
    return int(text)


def write_atomically(path: str, text: str, *, prefix: str, what: str) -> None:
    """Replace ``path`` with ``text`` atomically: a temporary file beside it, fsync, rename,
    fsync the directory; `FenceStateError` naming ``what`` when it cannot."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise FenceStateError(f"cannot write {what} {path!r}: {exc}") from exc


def write_ceiling(path: str, ceiling: int) -> None:
    """Persist ``ceiling`` atomically (see `write_atomically`)."""
    write_atomically(path, f"{ceiling}\n", prefix=".fence-", what="fence state file")


class CeilingStore(Protocol):
    """Where a fence ceiling survives the process (raises `FenceStateError` when it cannot)."""

    def read(self) -> int:
        """The stored ceiling, 0 when none was stored yet."""
        ...

    def write(self, ceiling: int) -> None:
        """Store ``ceiling`` durably before returning."""
        ...


class FileCeilingStore:
    """The ceiling in a file (``--fence-state-file``)."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> int:
        return read_ceiling(self.path)

    def write(self, ceiling: int) -> None:
        write_ceiling(self.path, ceiling)


class FenceCounter:
    """Issues tokens: 16 hex digits of counter, then 16 hex digits of randomness."""

    __slots__ = ("_ceiling", "_counter", "_lock", "_pool", "_pool_pos", "_random", "_store")

    def __init__(
        self,
        state_file: str | None = None,
        *,
        store: CeilingStore | None = None,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if state_file is not None and store is not None:
            raise ValueError("a fence counter takes a state file or a ceiling store, not both")
        self._store: CeilingStore | None = (
            FileCeilingStore(state_file) if state_file is not None else store
        )
        self._random = random_bytes
        self._lock = threading.Lock()
        self._pool = ""
        self._pool_pos = 0
        start = wall_clock_ns()
        if self._store is not None:
            start = max(start, self._store.read())
        self._counter = start
        self._ceiling = 0
        if self._store is not None:
            self._persist(start)

    @property
    def last(self) -> int:
        """The most recently issued counter value (or the seed, before any)."""
        return self._counter

    @property
    def ceiling(self) -> int:
        """The ceiling last stored (0 without a store): every counter issued is below it."""
        return self._ceiling

    def _persist(self, counter: int) -> None:
        assert self._store is not None
        ceiling = counter + c.FENCE_PERSIST_BLOCK
        self._store.write(ceiling)
        self._ceiling = ceiling

    def publish(self) -> int:
        """Store the current ceiling again (a no-op in effect) and return it.

        A cluster member calls it before handing a shard over: the next owner reads it.
        """
        with self._lock:
            if self._store is not None:
                self._store.write(self._ceiling)
            return self._ceiling

    def raise_to(self, floor: int) -> None:
        """Issue only counters above ``floor`` from now on (e.g. another member's ceiling).

        With a store, the raised ceiling is stored before this returns.
        """
        if floor > c.FENCE_MAX:
            raise OverflowError("fencing counter exhausted")
        with self._lock:
            if floor <= self._counter:
                return
            if self._store is not None and floor >= self._ceiling:
                self._persist(floor)
            self._counter = floor

    def next_token(self) -> str:
        """A new token whose counter is larger than every one issued before."""
        with self._lock:
            counter = self._counter + 1
            if counter > c.FENCE_MAX:
                raise OverflowError("fencing counter exhausted")
            if self._store is not None and counter >= self._ceiling:
                self._persist(counter)  # before issuing: a failed write issues nothing
            self._counter = counter
        pos = self._pool_pos
        if pos >= len(self._pool):
            self._pool = self._random(_CHUNK_BYTES).hex()
            pos = 0
        end = pos + 2 * _SUFFIX_BYTES
        self._pool_pos = end
        # counter <= FENCE_MAX (64 bits): its 8 bytes in hex are the 16 digits ("%016x")
        return counter.to_bytes(8, "big").hex() + self._pool[pos:end]


def fence_of(token: str) -> int:
    """The fencing counter carried by ``token``."""
    return int(token[: c.FENCE_HEX_CHARS], 16)
