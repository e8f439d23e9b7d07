"""Whether the lease journal is read through the page cache it was written through.

Within one boot a restart trusts the journal as the kernel has it, while the file system stays
mounted; unmounted (a repair on the same boot), what was not yet on the disk is gone. A start
tells the two apart by the state dir's unique mount id (Linux 6.8 and later), which the
journal's header records. Another mount is either the same file system bound once more (a
container's new bind: the page cache is still there) or one mounted anew: the journal's last
page, still cached (``tail_resident``) in the first case only, tells them apart. It also tells
whether a journal whose run could not write it is still whole: pages a failed fsync could not
write stay readable only while cached. Where the kernel cannot say, the journal is trusted."""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["mount_id", "tail_resident"]

_AT_FDCWD = -100
_STATX_MNT_ID_UNIQUE = 0x4000
_STATX_SIZE = 256
_STX_MNT_ID_OFFSET = 144  # where `struct statx` keeps `stx_mnt_id` (a `__u64`)
_SYS_CACHESTAT = 451
"""``cachestat``'s system call number (Linux 6.5), the same on all but alpha and mips."""


def mount_id(path: str) -> int | None:
    """The unique id of the mount ``path`` is on (``statx``'s ``STATX_MNT_ID_UNIQUE``), or None
    where the kernel or the C library gives none."""
    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    statx.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_MNT_ID_UNIQUE, buf) != 0:
        return None
    raw = buf.raw
    if not int.from_bytes(raw[0:4], "little") & _STATX_MNT_ID_UNIQUE:
        return None
    return int.from_bytes(raw[_STX_MNT_ID_OFFSET : _STX_MNT_ID_OFFSET + 8], "little")


def tail_resident(path: str) -> bool | None:
    """Whether the last byte of the file at ``path`` is in the page cache, or None where that
    cannot be told. Ask it before anything reads the file. ``cachestat`` (Linux 6.5) reads
    nothing in; without it, a read with ``RWF_NOWAIT``, whose miss starts reading the page in:
    done before that read looks again, now and then, a page that was not cached is found."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if (size := os.fstat(fd).st_size) == 0:
            return None
        if (cached := _cached_pages(fd, size - 1)) is not None:
            return cached > 0
        try:
            os.preadv(fd, [bytearray(1)], size - 1, os.RWF_NOWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return None
            raise
        return True
    finally:
        os.close(fd)


def _cached_pages(fd: int, offset: int) -> int | None:
    """How many pages of the file ``fd`` at ``offset`` (0 or 1) are in the page cache
    (``cachestat``), or None where the kernel or the C library gives no answer."""
    if os.uname().machine.startswith(("alpha", "mips")):
        return None  # their system call numbers are offset
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    span = (ctypes.c_uint64 * 2)(offset, 1)  # struct cachestat_range: off, len
    counts = (ctypes.c_uint64 * 5)()  # struct cachestat: nr_cache first
    return counts[0] if syscall(_SYS_CACHESTAT, fd, span, counts, 0) == 0 else None
