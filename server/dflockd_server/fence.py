"""Fencing tokens: a strictly increasing 64-bit counter plus a random suffix.

The counter starts at the wall clock in nanoseconds (so it keeps increasing across restarts
even without a state file: no server hands out a billion grants per second) and, when a fence
state file is configured, never below the ceiling persisted there. The file records a ceiling
``FENCE_PERSIST_BLOCK`` grants ahead of the counter; it is rewritten (atomically) only when the
counter reaches it, not on every grant.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable

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


class FenceCounter:
    """Issues tokens: 16 hex digits of counter, then 16 hex digits of randomness."""

    __slots__ = ("_ceiling", "_counter", "_path", "_pool", "_pool_pos", "_random")

    def __init__(
        self,
        state_file: str | None = None,
        *,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._path = state_file
        self._random = random_bytes
        self._pool = ""
        self._pool_pos = 0
        start = wall_clock_ns()
        if state_file is not None:
            start = max(start, read_ceiling(state_file))
        self._counter = start
        self._ceiling = 0
        if state_file is not None:
            self._persist(start)

    @property
    def last(self) -> int:
        """The most recently issued counter value (or the seed, before any)."""
        return self._counter

    def _persist(self, counter: int) -> None:
        assert self._path is not None
        ceiling = counter + c.FENCE_PERSIST_BLOCK
        write_ceiling(self._path, ceiling)
        self._ceiling = ceiling

    def next_token(self) -> str:
        """A new token whose counter is larger than every one issued before."""
        counter = self._counter + 1
        if counter > c.FENCE_MAX:
            raise OverflowError("fencing counter exhausted")
        if self._path is not None and counter >= self._ceiling:
            self._persist(counter)  # before issuing: a failed write issues nothing
        self._counter = counter
        pos = self._pool_pos
        if pos >= len(self._pool):
            self._pool = self._random(_CHUNK_BYTES).hex()
            pos = 0
        end = pos + 2 * _SUFFIX_BYTES
        self._pool_pos = end
        return f"{counter:016x}{self._pool[pos:end]}"


def fence_of(token: str) -> int:
    """The fencing counter carried by ``token``."""
    return int(token[: c.FENCE_HEX_CHARS], 16)
