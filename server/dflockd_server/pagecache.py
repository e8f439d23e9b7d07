"""Whether the lease journal is read through the page cache it was written through.

Within one boot a restart trusts the journal as the kernel has it: a ``kill -9`` loses nothing
written, even what the ``everysec`` fsync has not reached (``replay``), while the file system
stays mounted. Unmounted, what was not yet on the disk is gone: an operator who repairs a file
system a disk error turned read-only (unmount, ``fsck``, mount) on the same boot loses the
journal's last second of grants, while their holders still hold them.

A start tells the two apart by the state dir's mount (the kernel's unique mount id, Linux 6.8
and later: never reused within a boot), which the journal's header records. The same mount: the
same page cache. Another is either the same file system bound once more (a restarted
container's new bind of a volume that stayed mounted: the page cache is still there) or one
mounted anew (it is gone): the journal's last page, still cached (``tail_resident``, asked
before anything reads the file) in the first case only, tells them apart. Where the kernel gives
no unique mount id or cannot say whether a page is cached, nothing is recorded and the journal
is trusted.

The last page also tells whether a journal that could not be written when its run ended (no
``complete`` mark) is still whole: pages a failed fsync could not write stay readable only while
cached (``state``).
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["mount_id", "tail_resident"]

_AT_FDCWD = -100
_STATX_MNT_ID_UNIQUE = 0x4000
_STATX_SIZE = 256
_STX_MNT_ID_OFFSET = 144
"""Where ``struct statx`` keeps ``stx_mnt_id`` (a ``__u64``)."""


def mount_id(path: str) -> int | None:
    """The unique id of the mount ``path`` is on (``statx``'s ``STATX_MNT_ID_UNIQUE``), or None
    where the kernel or the C library gives none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
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
    """Whether the last byte of the file at ``path`` is in the page cache (a read that must not
    wait for the disk, ``RWF_NOWAIT``), or None where that cannot be told (no such file, an
    empty one, a file system or kernel without such reads). Ask it once, before anything reads
    the file: a miss may start reading the page in, and the next asking find it cached."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
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
