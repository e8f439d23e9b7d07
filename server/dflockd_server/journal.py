"""The lease journal: what the server granted, so that a restart loses no lock.

An append-only file in the state directory (``state``), one record per line::

    <crc32 of the payload, 8 lowercase hex digits> <payload>\\n

Payloads (fields separated by one space; a key and a token hold no space, a note is the rest of
the line and may)::

    H 3 <boot id>[.<mount id>] <wall ms> <monotonic ms> <fsync>   the clock anchor (first line)
    G <token> <key> <limit> <sem 0|1> <lease s> <until ms> <c|d> <onclose s|-> [<note>]
    X <token> <lease s> <until ms>                      the recorded expiry moved on
    M <token> <c|d> <onclose s|-> <lease s> <until ms> [<note>]   rebound (ht, hd, onclose)
    N <token> [<note>]                                  the owner note changed
    R <token>                                           released, expired or dropped
    C                                                   closed by a graceful stop (fsynced)
    K <crc32, 8 lowercase hex digits> <bytes>           the head of a batch (below)

A write of ``BATCH_RECORDS`` records or more puts a ``K`` line (checksum and length of the
records after it, ``BATCH_BYTES`` at most) before them: a restart checks them with one checksum.
A batch that does not check, or that the file ends inside, is read line by line: batches change
a read's speed, never its outcome.

``until`` is a wall-clock time in ms on the file's clock (the anchor's wall time plus the
monotonic time elapsed since: a wall-clock step does not move it): the lease's end as its holder
was last told, rounded up. Every renewal writes an ``X`` record before its reply leaves.

A restart on the same boot that restored every lease to its recorded end appends its own ``H``
record and goes on appending (``resume``); ``replay`` reads it back, the times after each later
header put on the first one's clock. Any other start writes a new file of every lease it
restored (``open``).

Writes: records go to a buffer, written with one ``os.write`` per turn of the loop (``flush``)
before the replies that follow them leave (``stream.GroupWrite``): a kill -9 loses nothing a
client was told. ``fsync``: ``always`` in that write, ``everysec`` on a background thread, ``no``
left to the OS (docs/server.md, "What a crash may lose"). A journal that cannot be written (a
full disk, EIO, a failed fsync: ``writable`` False) has the failed batch cut from the file, its
grants undone (``refused``), the ``complete`` mark removed, and drops records (nothing new is
granted); each sweep tries ``recover``: a new file of every lease held, fsynced beside the old
one and renamed over it."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from dflockd_server.fence import fsync_dir as _fsync_dir
from dflockd_server.pagecache import mount_id
from dflockd_server.recorded import RecordedGrant
from dflockd_server.replay import (
    BATCH_BYTES,
    BATCH_RECORDS,
    COMPLETE_SUFFIX,
    VERSION,
    boot_id,
    paused_gc,
)

if TYPE_CHECKING:
    from dflockd_server.keys import Holder, KeyState

__all__ = ["Journal", "JournalStats", "RecordedGrant", "drop_record", "paused_gc"]

log = logging.getLogger("dflockd_server")

COMPACT_MIN_BYTES = 4 * 1024 * 1024  # compact past this and four times what the live grants take
_LIVE_RECORD_BYTES = 128  # about what one live grant's record takes (for `wants_compaction`)
_crc32: Final = zlib.crc32  # bound once: compiled, a static, not a look-up per record
_write: Final = os.write
_HEX: Final = tuple(b"%02x" % i for i in range(256))
"""Each byte's two hex digits: compiled, four look-ups cost far less than ``%08x``."""


def _write_all(fd: int, view: memoryview, write: Callable[[int, memoryview], int]) -> None:
    """Write all of ``view`` to ``fd``. The count is kept in a local: compiled, mypyc evaluates
    a ``memoryview`` slice's start twice (``view[os.write(fd, view):]`` wrote twice)."""
    while view:
        written = write(fd, view)
        view = view[written:]


def _framed(payload: bytes) -> bytes:
    """``payload``'s record line: checksum, a space, the payload, LF (one bytes format)."""
    crc = _crc32(payload)
    return b"%s%s%s%s %s\n" % (
        _HEX[crc >> 24],
        _HEX[(crc >> 16) & 255],
        _HEX[(crc >> 8) & 255],
        _HEX[crc & 255],
        payload,
    )


def _batched(records: list[bytes]) -> list[bytes]:
    """``records`` in batches of ``BATCH_BYTES`` at most, each after its ``K`` line when it holds
    ``BATCH_RECORDS`` or more: the pieces of one write."""
    if len(records) < BATCH_RECORDS:
        return records
    parts: list[bytes] = []
    start = size = 0
    for i, record in enumerate(records):
        if size + len(record) > BATCH_BYTES and i > start:
            _add_batch(parts, records[start:i])
            start, size = i, 0
        size += len(record)
    _add_batch(parts, records[start:])
    return parts


def _add_batch(parts: list[bytes], group: list[bytes]) -> None:
    if len(group) >= BATCH_RECORDS:
        data = b"".join(group)
        parts.append(_framed(b"K %08x %d" % (_crc32(data), len(data))))
    parts.extend(group)


def drop_record(token: str) -> bytes:
    """The record of the end of the grant ``token`` (the hot path)."""
    return _framed(("R " + token).encode())


@dataclass(slots=True)
class JournalStats:
    """Running totals, read by ``stats`` and the metrics exporter (whether the journal can be
    written is ``Journal.writable``'s alone)."""

    restored: int = 0
    dropped_records: int = 0
    writes: int = 0
    fsyncs: int = 0
    compactions: int = 0
    write_failures: int = 0  # episodes in which it could not be written
    refused_grants: int = 0  # grants of a batch not written: undone, their replies refused


class Journal:
    """Appends the lock table's records, writes them at ``flush``, fsyncs by the policy, compacts,
    and notes when it cannot be written. On the server's loop; only the everysec fsync has a thread.

    ``clock`` is the table's: an expiry ``t`` on it is recorded as the wall time
    ``anchor_wall + (t - anchor_clock)``. Tests give failing ``fsync_file`` / ``fsync_dir``;
    the simulator (tests/sim) gives ``write`` and ``clocks`` (the anchor's clocks and ids)."""

    __slots__ = ("_anchor_clock", "_anchor_mono_ms", "_anchor_wall_ms", "_clock", "_clocks", "_fd",
                 "_fd_lock", "_fsync_dir", "_fsync_file", "_lifetime", "_must_sync",
                 "_said_read_only", "_size", "_sync_error", "_sync_on_loop", "_sync_wanted",
                 "_synced", "_syncer", "_write", "_written", "buf", "failure", "fsync",
                 "mark_removed", "path", "refused", "stats", "writable")  # fmt: skip

    def __init__(
        self,
        path: str,
        fsync: str,
        clock: Callable[[], float],
        *,
        fsync_file: Callable[[int], None] | None = None,
        fsync_dir: Callable[[str], None] | None = None,
        write: Callable[[int, bytes | memoryview], int] | None = None,
        clocks: Callable[[], tuple[int, int, str]] | None = None,
    ) -> None:
        self.path = path
        self.fsync = fsync
        self._clock = clock
        self._fsync_file = os.fsync if fsync_file is None else fsync_file
        self._fsync_dir = _fsync_dir if fsync_dir is None else fsync_dir
        self._write: Callable[[int, bytes | memoryview], int] = _write if write is None else write
        self._clocks = clocks  # `anchor`'s (wall ms, monotonic ms, lifetime); None: this machine's
        self.buf: list[bytes] = []  # records not written yet
        self._written = 0  # writes to the file so far
        self._synced = 0  # `_written` as it was before the last fsync that succeeded
        self._must_sync = False  # the buffer holds a record `always` fsyncs before its reply
        self._sync_error: OSError | None = None  # a background fsync's failure, for the next flush
        self.stats = JournalStats()
        self.writable = True
        self.failure = ""  # why it cannot be written (the episode's first error), "" while it can
        self._said_read_only = False  # this episode's log said the file system is read-only
        self.mark_removed = True
        """The ``complete`` mark is gone while the journal cannot be written: renewals may then
        be answered unrecorded (False: they are refused)."""
        self.refused: list[tuple[str, str]] = []
        """(key, token) of the grants of a batch that could not be written, undone by the
        caller before any reply of that batch leaves (``take_refused``)."""
        self._fd = -1
        self._fd_lock = threading.Lock()
        self._sync_wanted = threading.Event()  # for the everysec thread: fsync, or end once closed
        self._sync_on_loop = False  # no everysec thread could be started: the loop fsyncs
        self._syncer: threading.Thread | None = None
        self._size = 0
        self._anchor_clock = 0.0
        self._anchor_wall_ms = 0
        self._anchor_mono_ms = 0
        self._lifetime = "-"
        """The header's ``<boot id>[.<mount id>]`` (``pagecache``: a start after the state dir
        was mounted anew knows the last records may be gone)."""

    @property
    def dirty(self) -> bool:
        """Written since the last fsync that succeeded."""
        return self._written != self._synced

    def _until(self, expires_at: float) -> int:
        """The wall ms recorded for a lease ending at ``expires_at``."""
        return self._anchor_wall_ms + int((expires_at - self._anchor_clock) * 1000) + 1

    @staticmethod
    def _mode(detached: bool, on_close: int | None) -> str:
        """A record's ``<c|d> <onclose s|->`` (a constant without a close lease: the hot path)."""
        if on_close is None:
            return "d -" if detached else "c -"
        return ("d " if detached else "c ") + str(on_close)

    def grant_record(
        self, holder: Holder, state: KeyState | None, detached: bool, on_close: int | None
    ) -> bytes:
        """A grant's record (the hot path), the expiry it covers set in ``holder.covered``.
        ``state``: its key's, ``None`` for a lock that keeps none."""
        lease = holder.lease_ttl
        expires_at = holder.expires_at
        until = self._anchor_wall_ms + int((expires_at - self._anchor_clock) * 1000) + 1  # _until
        note = holder.note
        # A lock's limit and kind as one constant str (compiled, each formatted piece costs).
        if state is None or (state.limit == 1 and not state.is_sem):
            limit_kind = " 1 0 "
        else:
            limit_kind = f" {state.limit} {1 if state.is_sem else 0} "
        mode = self._mode(detached, on_close)
        tail = "" if note is None else " " + note
        self._must_sync = True
        holder.covered = expires_at
        return _framed(
            f"G {holder.token} {holder.key}{limit_kind}{lease} {until} {mode}{tail}".encode()
        )

    def extend(self, token: str, lease_ttl: int, expires_at: float) -> None:
        """Record that a lease now runs to ``expires_at``."""
        self.buf.append(_framed(f"X {token} {lease_ttl} {self._until(expires_at)}".encode()))

    def move(
        self,
        token: str,
        *,
        detached: bool,
        on_close: int | None,
        lease_ttl: int,
        expires_at: float,
        note: str | None,
    ) -> None:
        """Record a rebinding (``ht``, ``hd``, a detach at a close)."""
        until = self._until(expires_at)
        payload = f"M {token} {self._mode(detached, on_close)} {lease_ttl} {until}"
        if note is not None:
            payload += " " + note
        self.buf.append(_framed(payload.encode()))
        self._must_sync = True

    def note(self, token: str, note: str | None) -> None:
        self.buf.append(_framed((f"N {token}" if note is None else f"N {token} {note}").encode()))
        self._must_sync = True

    def _header(self) -> bytes:
        return _framed(
            f"H {VERSION} {self._lifetime} {self._anchor_wall_ms} {self._anchor_mono_ms} "
            f"{self.fsync}".encode()
        )

    @property
    def mark_path(self) -> str:
        return self.path + COMPLETE_SUFFIX

    def open(self, live: Iterable[bytes]) -> bool:
        """Atomically replace the file with the header and ``live`` (``grant_record``s made
        after ``anchor``). On an ``OSError`` (False) the old file stays and the journal is not
        writable: a start on a full disk serves what it restored."""
        try:
            self._replace(live)
        except OSError as exc:
            self._fail(exc, [])
            return False
        return True

    def resume(self, ended: Iterable[str]) -> None:
        """Instead of ``open``, go on appending to a journal the start read whole and restored
        (``StartPlan.resume``): this run's header, then the release of each grant in ``ended``.
        The file is fsynced before anything is served; a failure is as ``open``'s."""
        fd = size = -1
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            size = os.fstat(fd).st_size
            data = b"".join([self._header(), *(drop_record(token) for token in ended)])
            _write_all(fd, memoryview(data), self._write)
            self._fsync_file(fd)
        except OSError as exc:
            if size >= 0:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
            if fd >= 0:
                os.close(fd)
            self._fail(exc, [])
            return
        self._write_to(fd, size + len(data))

    def anchor(self) -> None:
        """Fix the clock anchor (before making the records ``open`` takes)."""
        self._anchor_clock = self._clock()
        if (clocks := self._clocks) is not None:
            self._anchor_wall_ms, self._anchor_mono_ms, self._lifetime = clocks()
            return
        self._anchor_wall_ms = time.time_ns() // 1_000_000
        self._anchor_mono_ms = time.monotonic_ns() // 1_000_000
        boot = boot_id()
        mount = mount_id(os.path.dirname(os.path.abspath(self.path)))
        self._lifetime = boot if mount is None or boot == "-" else f"{boot}.{mount}"

    def _replace(self, live: Iterable[bytes]) -> None:
        """Write the header and ``live`` to a new file, fsync it, rename it over the journal,
        move the writer to it, fsync the directory, make the ``complete`` mark. On ``OSError``
        before the rename the old file and its writer are untouched."""
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            data = b"".join([self._header(), *_batched(list(live))])
            _write_all(fd, memoryview(data), self._write)
            self._fsync_file(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if (old := self._write_to(fd, len(data))) >= 0:  # before anything else can fail
            os.close(old)
        self._fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        self.stats.fsyncs += 1
        os.close(os.open(self.mark_path, os.O_WRONLY | os.O_CREAT, 0o600))

    def _write_to(self, fd: int, size: int) -> int:
        """Move the writer to ``fd``, a file of ``size`` bytes just fsynced; the fd it had."""
        with self._fd_lock:
            old, self._fd = self._fd, fd
            self._size = size
            self._written += 1
            self._synced = self._written
        self.stats.fsyncs += 1
        return old

    def _fail(self, exc: OSError, batch: list[bytes]) -> None:
        """Note the grants of ``batch`` as ``refused`` and empty it; at an episode's start, log
        it and remove the ``complete`` mark."""
        for record in batch:
            if record[9:11] == b"G ":
                fields = record.split(b" ", 4)
                self.refused.append((fields[3].decode(), fields[2].decode()))
        batch.clear()
        if not self.writable:
            return
        self.writable = False
        self.stats.write_failures += 1
        self.failure = f"{exc.strerror or exc}"
        self.mark_removed = True
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.mark_path)
        except OSError as mark_exc:
            self.mark_removed = False
            log.critical(
                "journal: cannot remove %s (%s): renewals are refused too until the journal "
                "can be written (a restart could not know they were answered)",
                self.mark_path,
                mark_exc,
            )
        self._said_read_only = exc.errno == errno.EROFS
        log.error(
            "journal: cannot write %s (%s): granting nothing new until it can be written "
            "again (acquires are answered error_read_only); every lock held stays held; "
            "releases, ping and stats are answered, and renewals %s. %s",
            self.path,
            self.failure,
            "too"
            if self.mark_removed
            else "are refused (see above: each holder is told its lock is lost)",
            self.advice(),
        )

    def advice(self) -> str:
        """What to do while the journal cannot be written, as its log said ("" while it can)."""
        if self.writable:
            return ""
        directory = os.path.dirname(os.path.abspath(self.path))
        if not self._said_read_only:
            return (
                f"Free space (or fix the disk) under {directory}: the server resumes by itself "
                "within a sweep."
            )
        return (
            f"The file system under {directory} is read-only (a disk error?): the server cannot "
            "resume by itself. Stop it, repair the file system, and start it again: "
            + (
                "it sees the file system mounted anew and waits out the longest lease before "
                "granting (what the disk had not yet taken is gone)"
                if "." in self._lifetime
                else "with --restart-grace set to the longest lease (this kernel gives no "
                "mount id by which the start could see the file system mounted anew, and what "
                "the disk had not yet taken is gone)"
            )
        )

    def take_refused(self) -> list[tuple[str, str]]:
        refused, self.refused = self.refused, []
        self.stats.refused_grants += len(refused)
        return refused

    def flush(self) -> None:
        """Write the buffer (one ``os.write``; fsynced too with ``always`` and a grant, a move
        or a note in it). Raises nothing: a failure makes the journal not ``writable``."""
        buf = self.buf
        if self._sync_error is not None:
            exc, self._sync_error = self._sync_error, None
            self._fail(exc, buf)
            return
        if not buf:
            return
        if not self.writable:
            buf.clear()
            return
        data = buf[0] if len(buf) == 1 else b"".join(_batched(buf))
        fd = self._fd
        try:
            written = self._write(fd, data)
            if written < len(data):  # a short write: a full disk, or a signal
                _write_all(fd, memoryview(data)[written:], self._write)
        except OSError as exc:  # cut what got in: the file ends with a whole record
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._size)
            self._fail(exc, buf)
            return
        self._size += len(data)
        self._written += 1
        self.stats.writes += 1
        if self.fsync == "always" and self._must_sync:
            # Renewals and releases alone are not fsynced: after a machine crash no restore
            # reads a renewal's end (each lease runs at least the longest recorded), and a
            # lost release keeps a lease one lease more.
            self._must_sync = False
            try:
                self._fsync_file(fd)
            except OSError as exc:
                self._fail(exc, buf)
                return
            self._synced = self._written
            self.stats.fsyncs += 1
        buf.clear()

    def sync(self) -> None:
        """fsync what was written (any thread); a failure is kept for the next ``flush``."""
        with self._fd_lock:
            if (fd := self._fd) < 0:
                return
            written = self._written
            try:
                self._fsync_file(fd)
            except OSError as exc:
                self._sync_error = exc
                raise
            self._synced = written
            self.stats.fsyncs += 1

    def sync_in_background(self) -> None:
        """``everysec``: have the fsync thread fsync what was written. Where no thread can be
        started (a container at its pid limit), the fsync runs on the loop until one can."""
        if self.fsync != "everysec" or not self.dirty or not self.writable:
            return
        if self._syncer is None or not self._syncer.is_alive():
            syncer = threading.Thread(target=self._sync_when_wanted, name="dflockd-journal-fsync")
            syncer.daemon = True
            try:
                syncer.start()
            except RuntimeError as exc:  # "can't start new thread"
                if not self._sync_on_loop:
                    self._sync_on_loop = True
                    log.error("journal: no thread for the everysec fsync (%s): on the loop", exc)
                self._sync_logged()
                return
            self._syncer = syncer
            if self._sync_on_loop:
                self._sync_on_loop = False
                log.info("journal: the everysec fsync has its thread again")
        self._sync_wanted.set()

    def _sync_when_wanted(self) -> None:
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._fd < 0:
                return
            self._sync_logged()

    def _sync_logged(self) -> None:
        try:
            self.sync()
        except OSError as exc:
            log.error("journal: fsync of %s failed: %s", self.path, exc)

    def wants_compaction(self, live: int) -> bool:
        """Whether the file holds mostly records of leases gone (``COMPACT_MIN_BYTES``)."""
        return self._size > max(COMPACT_MIN_BYTES, 4 * _LIVE_RECORD_BYTES * live)

    def compact(self, live: Iterable[bytes]) -> None:
        """Rewrite the file with only ``live`` (the current grants)."""
        self.flush()
        if self.writable and self.open(live):
            self.stats.compactions += 1

    def recover(self, live: Iterable[bytes]) -> bool:
        """Try a new file holding ``live`` (every lease held now); True once writable."""
        if self.writable:
            return True
        self.buf.clear()
        self._sync_error = None
        try:
            self._replace(live)
        except OSError as exc:
            if exc.errno == errno.EROFS and not self._said_read_only:
                # The episode began with another error (an fsync's EIO, say): say this one's.
                self._said_read_only = True
                log.error(
                    "journal: cannot write %s (%s): %s",
                    self.path,
                    exc.strerror or exc,
                    self.advice(),  # not writable, said read-only: the read-only advice
                )
            return False
        self.refused.clear()
        self.writable = True
        self.mark_removed = True
        self._said_read_only = False
        log.warning(
            "journal: %s can be written again (it could not: %s); granting again",
            self.path,
            self.failure,
        )
        self.failure = ""
        return True

    def close(self) -> None:
        """Write what is buffered and a ``C`` record, fsync, and close the file (a failed fsync
        raises, the ``C`` record cut and the ``complete`` mark removed)."""
        closing = _framed(b"C")
        try:
            if self.writable:
                self.buf.append(closing)
                self.flush()
                if self.writable:
                    try:
                        self.sync()
                    except OSError:
                        # What the fsync could not write may be lost: neither the ``C`` nor
                        # the ``complete`` mark may tell the next start that the file is whole.
                        with contextlib.suppress(OSError):
                            os.ftruncate(self._fd, self._size - len(closing))
                        with contextlib.suppress(OSError):
                            os.unlink(self.mark_path)
                        raise
        finally:
            with self._fd_lock:
                fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)
            self._sync_wanted.set()  # the everysec thread ends
