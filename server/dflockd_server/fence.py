"""Fencing tokens' persistent side: where the counter's ceiling survives a restart (a file, or in
cluster mode an etcd key, ``cluster.fencestore``), its error, and ``fence_of``. Issuing tokens is
``tokens.FenceCounter``'s (this module is not compiled: its error derives from ``OSError``)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Protocol

from dflockd_server import constants as c


class FenceStateError(OSError):
    """The fence state file cannot be read or written."""


class StateUnwritable(FenceStateError):
    """The lease bound's record could not be written to the state directory (not etcd)."""


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
    """Replace ``path`` with ``text`` atomically and durably (`FenceStateError` naming ``what``)."""
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
        fsync_dir(directory)
    except OSError as exc:
        raise FenceStateError(f"cannot write {what} {path!r}: {exc}") from exc


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CeilingStore(Protocol):
    """Where a fence ceiling survives the process (raises `FenceStateError` when it cannot)."""

    def read(self) -> int:
        """The stored ceiling, 0 when none was stored yet."""
        ...

    def write(self, ceiling: int) -> None:
        """Store ``ceiling`` durably."""
        ...


class FileCeilingStore:
    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> int:
        return read_ceiling(self.path)

    def write(self, ceiling: int) -> None:
        write_atomically(self.path, f"{ceiling}\n", prefix=".fence-", what="fence state file")


def fence_of(token: str) -> int:
    return int(token[: c.FENCE_HEX_CHARS], 16)
