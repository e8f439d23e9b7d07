"""The lease journal: what the server granted, so that a restart loses no lock.

An append-only file in the state directory (``state``), one record per line::

    <crc32 of the payload, 8 lowercase hex digits> <payload>\\n

Payloads (fields separated by one space; a key and a token hold no space, a note is the rest of
the line and may)::

    H 2 <boot id> <wall ms> <monotonic ms> <fsync>    the file's clock anchor (its first line)
    G <token> <key> <limit> <sem 0|1> <lease s> <until ms> <c|d> <onclose s|-> [<note>]
    X <token> <lease s> <until ms>                      the recorded expiry moved on
    M <token> <c|d> <onclose s|-> <lease s> <until ms> [<note>]   rebound (ht, hd, onclose)
    N <token> [<note>]                                  the owner note changed
    R <token>                                           released, expired or dropped
    C                                                   closed by a graceful stop (fsynced)

``until`` is a wall-clock time in milliseconds, on the file's clock: the anchor's wall time plus
the monotonic time elapsed since (so a wall-clock step during the run does not move it). It is
the lease's end as its holder was last told (rounded up to the next millisecond): every renewal
writes an ``X`` record, group-committed with the grants (``stream.GroupWrite``), before its
reply leaves. (``record_renewals=False``, for benchmarks/journal.py's A/B only, records a lease
one lease ahead instead, so that a renewal writes nothing until its new end passes that.)

Restoring (``read_journal``, ``restored_leases``): every grant with no later ``R`` comes back.
How long it runs from the restart depends on what the file can prove:

- **same boot, complete journal** (the file's boot id is this boot's, and the ``complete`` mark
  beside it says every renewal answered is recorded): ``min(until - now, lease)``, ``now`` on
  the file's own clock (monotonic time elapsed since the anchor, immune to any wall-clock
  step). The restored end is the real end, within a millisecond plus the time the restart took
  to read the clock; a grant bound to a connection with an ``<onclose>`` lease runs at least
  that long (its connection closed with the old process).
- **same boot, journal not complete** (renewals were answered while the journal could not be
  written, or an older version wrote it): each lease runs ``max(its lease, the longest lease
  the run recorded)`` from the restart. A renewal answered before the crash ended at most one
  such lease after it, and the crash came before the restart.
- **another boot** (or a boot id that cannot be read): the wall clock cannot be trusted across a
  boot (it may have been stepped either way), so nothing is measured with it: each lease runs a
  full lease from the restart, the longest of its own and the longest the run recorded (which
  is fsynced before any longer lease is granted or renewed: a renewal's record is not fsynced
  even with ``always``, see ``flush``). If the file was not fsynced at each reply
  (``--journal-fsync`` other than ``always``) and not closed by a graceful stop, the last
  records may be lost with the machine's crash, so the start also grants nothing for the
  longest lease the run recorded (the restart grace, ``state``).

The restored end is never earlier than the real one: within a boot the file is read as the
kernel has it (a ``kill -9`` loses nothing written), and the ``complete`` mark is removed before
any renewal goes unrecorded.

Damage: reading stops at the first line that does not check. A last record without its end
of line (a write cut short by a crash of the machine) is a torn tail: dropped, and only that
record (never acknowledged with ``always``) is lost. Any other damage (a whole line that does
not check, two lines run together) means records after it are unknown: the caller then applies
a restart grace (``state``).

A journal that cannot be written (a full disk, EIO, a quota, a failed fsync: ``writable`` is
then False): the batch that failed is cut from the file, its grants are handed back to the
caller (``refused``: they are undone and their replies refused, never sent), the ``complete``
mark is removed, and from then on records are not buffered (the server grants nothing new; it
answers renewals, releases, ``ping`` and ``stats``). Each sweep tries ``recover``: a new file with
every lease held now, written and fsynced beside the old one, renamed over it, the directory
fsynced; on success the journal is writable again. The writer is always on the file that is the
journal on disk: after the rename it moves to the new file before anything else can fail.

Writes: records are appended to a buffer. A connection whose reply follows records not written
yet holds its replies back (``stream``); once per turn of the loop the server writes the buffer
with one ``os.write`` (``flush``) and then sends every reply held back, so a kill -9 of the
process loses nothing a client was told, and the connections of one turn share one write (a
group commit). A connection alone in its turns writes the buffer itself, just before its
replies (``stream.GroupWrite``), unless the fsync is ``always``. ``fsync``: ``always`` (in that
write, before those replies: one fsync for all), ``everysec`` (a background thread, once a
second: a crash of the machine may lose the last second), ``no`` (the OS decides). An fsync
that fails is a failure to write (above): nothing is marked synced until an fsync succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from dflockd_server.keys import AS_RECORDED

if TYPE_CHECKING:
    from dflockd_server.keys import Holder, KeyState

__all__ = [
    "FSYNC_MODES",
    "Journal",
    "JournalRead",
    "JournalStats",
    "RecordedGrant",
    "Restore",
    "boot_id",
    "drop_record",
    "read_journal",
    "restored_leases",
]

log = logging.getLogger("dflockd_server")

FSYNC_MODES = ("always", "everysec", "no")
VERSION = "2"
"""Written in the header; version 1 (no fsync field) is read too."""
RECORD_RENEWALS = True
"""Whether a journal records every renewal (``Journal``'s default). Never changed by the
server: benchmarks/journal.py's ``--renewals`` A sets it to False in its own child process, to
measure what the records cost against the cover they replaced."""
COMPLETE_SUFFIX = ".complete"
"""The mark beside the journal: present while every renewal answered is in the file."""
COMPACT_MIN_BYTES = 4 * 1024 * 1024
"""The journal is compacted once it is past this size and four times what its live grants
take: under steady churn that is a rewrite of a few live records every ~60,000 records."""
_LIVE_RECORD_BYTES = 128
"""About what one live grant's record takes (for ``wants_compaction``)."""
_CRC_DIGITS = b"0123456789abcdef"
"""What a record's checksum field is made of, as written (``%08x``): ``int(field, 16)``
alone also takes a space, a sign, an underscore or a ``0x`` in it."""


def boot_id() -> str:
    """This boot of the machine (Linux's boot id), or ``-`` where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            text = fh.read().strip().replace("-", "")
    except OSError:
        return "-"
    return text or "-"


_crc32: Final = zlib.crc32
"""Bound once (compiled: a static, not a look-up of ``crc32`` on the module per record)."""
_write: Final = os.write
"""Likewise, once per write of the journal."""
_HEX: Final = tuple(b"%02x" % i for i in range(256))
"""Each byte's two hex digits: a record's checksum is four look-ups here. Compiled, a
``to_bytes`` and a ``hex`` are calls by name (about 850 instructions) and a ``%08x`` format
more (about 1,300); interpreted, this costs about what those did (measured both ways for
each of the forms tried)."""


def _write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` to ``fd``, however many writes it takes.

    The count each write returns is kept in a local before the view is cut: compiled, mypyc
    (mypy 2.4.1) evaluates a slice's start twice when the sliced object is a ``memoryview``, so
    ``view[os.write(fd, view):]`` wrote everything twice (every new journal file began with
    its header and live records twice)."""
    while view:
        written = _write(fd, view)
        view = view[written:]


def _framed(payload: bytes) -> bytes:
    """``payload``'s record line: the checksum of its bytes in 8 lowercase hex digits, a space,
    the payload, LF. Built as bytes in one piece (compiled, a ``%s`` format of bytes is one
    build): the payload is encoded once, and not copied into a str first."""
    crc = _crc32(payload)
    return b"%s%s%s%s %s\n" % (
        _HEX[crc >> 24],
        _HEX[(crc >> 16) & 255],
        _HEX[(crc >> 8) & 255],
        _HEX[crc & 255],
        payload,
    )


def _line(payload: str) -> bytes:
    """``payload``'s record line (``_framed``, of its UTF-8)."""
    return _framed(payload.encode())


def drop_record(token: str) -> bytes:
    """The record of the release (or expiry) of the grant ``token`` (the hot path)."""
    return _framed(("R " + token).encode())


@dataclass(slots=True)
class RecordedGrant:
    """One grant as the journal last recorded it."""

    token: str
    key: str
    limit: int
    is_sem: bool
    lease_ttl: int
    until_ms: int
    detached: bool
    on_close: int | None
    note: str | None


@dataclass(slots=True)
class JournalRead:
    """What ``read_journal`` found."""

    leases: dict[str, RecordedGrant] = field(default_factory=lambda: {})
    """Token -> the grants not released, in grant order."""
    anchor: tuple[str, int, int] | None = None
    """The file's clock anchor: boot id, wall ms, monotonic ms."""
    fsync: str = ""
    """The ``--journal-fsync`` of the run that wrote it ("" for a version-1 file)."""
    clean: bool = False
    """Its last record is a graceful stop's (``C``, fsynced)."""
    records: int = 0
    """Records read and applied."""
    dropped_bytes: int = 0
    """Bytes from the first damaged line to the end of the file."""
    dropped_lines: int = 0
    """Lines from the first damaged line on (the damaged one included)."""
    damage: str = ""
    """What was wrong with the first line that did not check ("" when none)."""
    torn_tail: bool = False
    """The damage is a last record without its end of line: a write cut short."""

    @property
    def damaged_before_tail(self) -> bool:
        return bool(self.damage) and not self.torn_tail


def _apply(read: JournalRead, payload: str) -> str | None:
    """Apply one checked payload; a problem description when it is malformed."""
    kind, _, rest = payload.partition(" ")
    leases = read.leases
    read.clean = False
    if kind == "R":
        leases.pop(rest, None)
        return None
    if kind == "G":
        parts = rest.split(" ", 8)
        if len(parts) < 8:
            return "grant record with too few fields"
        token, key, limit, sem, lease, until, mode, on_close = parts[:8]
        leases[token] = RecordedGrant(
            token,
            key,
            int(limit),
            sem == "1",
            int(lease),
            int(until),
            mode == "d",
            None if on_close == "-" else int(on_close),
            parts[8] if len(parts) > 8 else None,
        )
        return None
    if kind == "X":
        token, lease, until = rest.split(" ")
        rec = leases.get(token)
        if rec is not None:
            rec.lease_ttl, rec.until_ms = int(lease), int(until)
        return None
    if kind == "M":
        parts = rest.split(" ", 5)
        if len(parts) < 5:
            return "move record with too few fields"
        rec = leases.get(parts[0])
        if rec is not None:
            rec.detached = parts[1] == "d"
            rec.on_close = None if parts[2] == "-" else int(parts[2])
            rec.lease_ttl, rec.until_ms = int(parts[3]), int(parts[4])
            rec.note = parts[5] if len(parts) > 5 else None
        return None
    if kind == "N":
        token, _, note = rest.partition(" ")
        rec = leases.get(token)
        if rec is not None:
            rec.note = note or None
        return None
    if kind == "H":
        parts = rest.split(" ")
        if not ((parts[0] == "1" and len(parts) == 4) or (parts[0] == VERSION and len(parts) == 5)):
            return f"header of an unknown journal version ({rest[:40]!r})"
        read.anchor = (parts[1], int(parts[2]), int(parts[3]))
        read.fsync = parts[4] if len(parts) == 5 else ""
        return None
    if kind == "C":
        read.clean = True
        return None
    return f"unknown record kind {kind[:8]!r}"


def read_journal(path: str) -> JournalRead:
    """Read the journal at ``path`` up to its first damaged line (see the module's doc).
    Raises ``OSError`` when the file cannot be read; a missing file reads as empty."""
    read = JournalRead()
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return read
    pos = 0
    size = len(data)
    while pos < size:
        end = data.find(b"\n", pos)
        line = data[pos:] if end < 0 else data[pos:end]
        problem = None
        if end < 0:
            problem = "a record without its end of line (a write cut short)"
        elif len(line) < 10 or line[8:9] != b" " or line[:8].translate(None, _CRC_DIGITS):
            # (what `translate` leaves is what is not a lowercase hex digit)
            problem = "a line that is not a record"
        else:
            payload = line[9:]
            if int(line[:8], 16) != zlib.crc32(payload):
                problem = "a record whose checksum does not match"
            else:
                try:
                    problem = _apply(read, payload.decode())
                except (ValueError, UnicodeDecodeError) as exc:
                    problem = f"a record that does not parse ({exc})"
        if problem is not None:
            rest = data[pos:]
            read.damage = problem
            read.dropped_bytes = len(rest)
            read.dropped_lines = rest.count(b"\n") + (0 if rest.endswith(b"\n") else 1)
            # Only a write cut short leaves a record without its end of line; a whole line that
            # does not check (two lines run together by a lost end of line included) is damage.
            read.torn_tail = b"\n" not in rest
            break
        read.records += 1
        pos = end + 1
    return read


@dataclass(frozen=True, slots=True)
class Restore:
    """What ``restored_leases`` makes of a journal."""

    leases: list[tuple[RecordedGrant, float]]
    """The grants still running, each with its seconds left, in grant order."""
    how: str
    """Which rule gave their time left, in the operator's terms (for the start-up log)."""
    grace_s: float
    """Seconds during which the start grants nothing (0: none): the journal may lack records
    of grants acknowledged last (see the module's doc)."""


def restored_leases(
    read: JournalRead,
    *,
    complete: bool = True,
    run_longest: int = 0,
    wall_ms: int | None = None,
    monotonic_ms: int | None = None,
    this_boot: str | None = None,
) -> Restore:
    """The grants of ``read`` still running now, each with its seconds left (the module's doc
    gives the rules). ``complete``: the journal's ``complete`` mark is there; ``run_longest``:
    the longest lease its run recorded (``grace``), 0 when unknown. The clock arguments are for
    tests."""
    mono = time.monotonic_ns() // 1_000_000 if monotonic_ms is None else monotonic_ms
    boot = boot_id() if this_boot is None else this_boot
    anchor = read.anchor
    same_boot = anchor is not None and anchor[0] != "-" and anchor[0] == boot and mono >= anchor[2]
    out: list[tuple[RecordedGrant, float]] = []
    grace = 0.0
    if anchor is None:  # not even a whole header: the file was never a run's journal
        return Restore(out, "the journal holds no header: nothing was recorded in it", grace)
    if same_boot and complete:
        now = anchor[1] + (mono - anchor[2])  # the file's own clock: no wall-clock step
        how = "same boot: each lease until its recorded end, on the monotonic clock"
        for rec in read.leases.values():
            longest = max(rec.lease_ttl, rec.on_close or 0)
            left = min((rec.until_ms - now) / 1000.0, float(rec.lease_ttl))
            if rec.on_close is not None and not rec.detached:
                left = max(left, float(rec.on_close))  # its connection closed with the process
            left = min(left, float(longest))
            if left > 0:
                out.append((rec, left))
        return Restore(out, how, grace)
    durable = read.clean or read.fsync == "always"
    if same_boot:
        how = (
            "same boot, but the journal may lack renewals (answered while it could not be "
            f"written): each lease for the longest of its own and {run_longest} s from now"
        )
        floor = run_longest
    elif complete and durable:
        how = (
            "another boot (the wall clock is not trusted across a boot): each lease for the "
            f"longest of its own and {run_longest} s (the longest the run recorded) from now"
        )
        floor = run_longest
    else:
        how = (
            "another boot (the wall clock is not trusted across a boot), and the journal was "
            + (
                "not fsynced at each reply"
                if complete
                else "not complete (renewals answered while it could not be written)"
            )
            + f": each lease for the longest of its own and {run_longest} s from now, and no "
            "grant until then (records of the last moments may be lost)"
        )
        floor = run_longest
        grace = float(run_longest)
    for rec in read.leases.values():
        left = float(max(rec.lease_ttl, rec.on_close or 0, floor))
        out.append((rec, left))
        grace = max(grace, left) if grace else grace
    return Restore(out, how, grace)


@dataclass(slots=True)
class JournalStats:
    """Running totals, read by ``stats`` and the metrics exporter."""

    restored: int = 0
    dropped_records: int = 0
    writes: int = 0
    fsyncs: int = 0
    compactions: int = 0
    writable: bool = True
    """Whether the journal can be written now (False: no new grant until it can)."""
    write_failures: int = 0
    """Episodes in which it could not be written (each counted once, at its start)."""
    refused_grants: int = 0
    """Grants made in a batch that could not be written: undone, their replies refused."""


class Journal:
    """Appends records (``grant``, ``extend``, ``move``, ``note``, ``drop``) for the lock
    table, writes them at ``flush``, fsyncs by the policy, compacts, and notes when it cannot
    be written (``writable``; ``recover`` tries again). Runs on the server's loop; only the
    everysec fsync runs in a thread of its own (``sync_in_background``).

    ``clock`` is the table's clock (the loop's monotonic time): an expiry ``t`` on it is
    recorded as the wall time ``anchor_wall + (t - anchor_clock)``. ``fsync_file`` and
    ``fsync_dir`` are ``os.fsync`` and a directory's fsync; tests give ones that fail (no real
    way makes the kernel fail an fsync on demand: a full disk fails writes, not fsyncs).
    """

    __slots__ = (
        "_anchor_clock",
        "_anchor_mono_ms",
        "_anchor_wall_ms",
        "_clock",
        "_fd",
        "_fd_lock",
        "_fsync_dir",
        "_fsync_file",
        "_must_sync",
        "_size",
        "_sync_error",
        "_synced",
        "_syncing",
        "_written",
        "buf",
        "failure",
        "fsync",
        "mark_removed",
        "path",
        "record_renewals",
        "refused",
        "stats",
        "writable",
    )

    def __init__(
        self,
        path: str,
        fsync: str,
        clock: Callable[[], float],
        *,
        record_renewals: bool | None = None,
        fsync_file: Callable[[int], None] | None = None,
        fsync_dir: Callable[[str], None] | None = None,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}")
        self.path = path
        self.fsync = fsync
        self.record_renewals = RECORD_RENEWALS if record_renewals is None else record_renewals
        """Every renewal writes a record (see the module's doc); False: benchmarks' A only."""
        self._clock = clock
        self._fsync_file = os.fsync if fsync_file is None else fsync_file
        self._fsync_dir = _fsync_dir if fsync_dir is None else fsync_dir
        self.buf: list[bytes] = []
        """Records not written yet (``flush`` writes them)."""
        self._written = 0
        """Writes to the file so far (``flush``, ``_replace``)."""
        self._synced = 0
        """``_written`` as it was before the last fsync that succeeded."""
        self._must_sync = False
        """The buffer holds a record that ``always`` fsyncs before its reply (a grant, a
        move, a note; not a renewal's or a release's: see ``flush``)."""
        self._sync_error: OSError | None = None
        """A background fsync failed (read by the next ``flush``, on the loop)."""
        self.stats = JournalStats()
        self.writable = True
        """False from a failed write (or fsync) until ``recover`` succeeds."""
        self.failure = ""
        """Why it cannot be written (the episode's first error), "" while it can."""
        self.mark_removed = True
        """The ``complete`` mark is gone (or was never made) while the journal cannot be
        written: renewals may then be answered unrecorded (False: they are refused)."""
        self.refused: list[tuple[str, str]] = []
        """(key, token) of the grants of a batch that could not be written, for the caller to
        undo before any reply of that batch leaves (``take_refused``)."""
        self._fd = -1
        self._fd_lock = threading.Lock()
        self._syncing = False
        self._size = 0
        self._anchor_clock = 0.0
        self._anchor_wall_ms = 0
        self._anchor_mono_ms = 0

    @property
    def dirty(self) -> bool:
        """Written since the last fsync that succeeded."""
        return self._written != self._synced

    # ------------------------------------------------------------------ records
    def _until(self, expires_at: float, lease_ttl: int) -> int:
        """The wall ms recorded for a lease ending at ``expires_at`` (one lease ahead without
        ``record_renewals``)."""
        ahead = 0 if self.record_renewals else lease_ttl
        return self._anchor_wall_ms + int((expires_at + ahead - self._anchor_clock) * 1000) + 1

    @staticmethod
    def _mode(detached: bool, on_close: int | None) -> str:
        """A record's ``<c|d> <onclose s|->``: without a close lease, a constant (compiled,
        every str built and int formatted costs, and a grant's record is the hot path)."""
        if on_close is None:
            return "d -" if detached else "c -"
        return ("d " if detached else "c ") + str(on_close)

    def grant_record(
        self, holder: Holder, state: KeyState | None, detached: bool, on_close: int | None
    ) -> bytes:
        """A grant's record (one format: the hot path), with the expiry it covers set in
        ``holder.covered`` (its end; ``AS_RECORDED`` without ``record_renewals``: renewals up
        to one lease past it write nothing). ``state``: its key's state, ``None`` for a lock
        that keeps none (limit 1, a lock's kind)."""
        lease = holder.lease_ttl
        expires_at = holder.expires_at
        # self._until, inlined: the hot path
        ahead = 0 if self.record_renewals else lease
        until = self._anchor_wall_ms + int((expires_at + ahead - self._anchor_clock) * 1000) + 1
        note = holder.note
        # The fields between the key and the lease as one str (compiled, every piece of an
        # f-string and every int formatted costs): a lock's limit and kind are a constant.
        if state is None or (state.limit == 1 and not state.is_sem):
            limit_kind = " 1 0 "
        else:
            limit_kind = f" {state.limit} {1 if state.is_sem else 0} "
        mode = self._mode(detached, on_close)
        tail = "" if note is None else " " + note
        self._must_sync = True
        # its end (the same float: nothing allocated), or expires_at + lease without one
        holder.covered = expires_at if self.record_renewals else AS_RECORDED
        return _framed(
            f"G {holder.token} {holder.key}{limit_kind}{lease} {until} {mode}{tail}".encode()
        )

    def extend(self, token: str, lease_ttl: int, expires_at: float) -> float:
        """Record that a lease now runs to ``expires_at``; returns the expiry covered."""
        until = self._until(expires_at, lease_ttl)
        self.buf.append(_line(f"X {token} {lease_ttl} {until}"))
        return expires_at if self.record_renewals else expires_at + lease_ttl

    def move(
        self,
        token: str,
        *,
        detached: bool,
        on_close: int | None,
        lease_ttl: int,
        expires_at: float,
        note: str | None,
    ) -> float:
        """Record a rebinding (``ht``, ``hd``, a detach at a close); returns the expiry
        covered."""
        longest = max(lease_ttl, on_close or 0)
        until = self._until(expires_at, longest)
        payload = f"M {token} {self._mode(detached, on_close)} {lease_ttl} {until}"
        if note is not None:
            payload += " " + note
        self.buf.append(_line(payload))
        self._must_sync = True
        return expires_at if self.record_renewals else expires_at + longest

    def note(self, token: str, note: str | None) -> None:
        self.buf.append(_line(f"N {token}" if note is None else f"N {token} {note}"))
        self._must_sync = True

    def drop(self, token: str) -> None:
        self.buf.append(drop_record(token))

    # ------------------------------------------------------------------ file
    def _header(self) -> bytes:
        return _line(
            f"H {VERSION} {boot_id()} {self._anchor_wall_ms} {self._anchor_mono_ms} {self.fsync}"
        )

    @property
    def mark_path(self) -> str:
        """The ``complete`` mark (see the module's doc)."""
        return self.path + COMPLETE_SUFFIX

    def open(self, live: Iterable[bytes]) -> None:
        """Start a new file holding the header and ``live`` (grant records made with
        ``grant_record`` after ``anchor``), replacing the old one atomically. When that fails
        (``OSError``), the old file stays the journal, and this one is not writable (``recover``
        tries again): a start on a full disk serves what it restored."""
        try:
            self._replace(live)
        except OSError as exc:
            self._fail(exc, [])

    def anchor(self) -> None:
        """Fix the clock anchor (before making the records ``open`` takes)."""
        self._anchor_clock = self._clock()
        self._anchor_wall_ms = time.time_ns() // 1_000_000
        self._anchor_mono_ms = time.monotonic_ns() // 1_000_000

    def _replace(self, live: Iterable[bytes]) -> None:
        """Write a new file (the header, ``live``) beside the journal, fsync it, rename it over
        the journal, move the writer to it, fsync the directory, then make the ``complete``
        mark. Raises ``OSError`` when any step fails: before the rename the old file (and the
        writer on it) is left as it was; after it the writer is on the new file already."""
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            data = b"".join([self._header(), *live])
            _write_all(fd, memoryview(data))
            self._fsync_file(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # The file at self.path is the new one: the writer moves to it before anything else
        # can fail (it never appends to a file that is no longer the journal).
        with self._fd_lock:
            old, self._fd = self._fd, fd
            self._size = len(data)
            self._written += 1
            self._synced = self._written  # fsynced above
        if old >= 0:
            os.close(old)
        self.stats.fsyncs += 1
        self._fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        self.stats.fsyncs += 1
        os.close(os.open(self.mark_path, os.O_WRONLY | os.O_CREAT, 0o600))

    def _fail(self, exc: OSError, batch: list[bytes]) -> None:
        """The journal cannot be written: note the grants of ``batch`` (``refused``), and at
        the start of an episode log it once, remove the ``complete`` mark and stop recording."""
        for record in batch:
            if record[9:11] == b"G ":
                fields = record.split(b" ", 4)
                self.refused.append((fields[3].decode(), fields[2].decode()))
        if not self.writable:
            return
        self.writable = False
        self.stats.writable = False
        self.stats.write_failures += 1
        self.failure = f"{exc.strerror or exc}"
        try:
            os.unlink(self.mark_path)
        except FileNotFoundError:
            self.mark_removed = True
        except OSError as mark_exc:
            self.mark_removed = False
            log.critical(
                "journal: cannot remove %s (%s): renewals are refused too until the journal "
                "can be written (a restart could not know they were answered)",
                self.mark_path,
                mark_exc,
            )
        else:
            self.mark_removed = True
        log.error(
            "journal: cannot write %s (%s): granting nothing new until it can be written "
            "again (acquires are answered error_unavailable); every lock held stays held, and "
            "renewals, releases, ping and stats are answered. Free space (or fix the disk) "
            "under %s: the server resumes by itself within a sweep",
            self.path,
            self.failure,
            os.path.dirname(os.path.abspath(self.path)),
        )

    def take_refused(self) -> list[tuple[str, str]]:
        """The grants refused since the last call (see ``refused``)."""
        refused, self.refused = self.refused, []
        self.stats.refused_grants += len(refused)
        return refused

    def flush(self) -> None:
        """Write the buffered records (one ``os.write``); with ``always``, fsync too when they
        hold a grant, a move or a note. Called
        before the replies that follow the records are sent (the server's group write, or a
        connection alone in its turns), and by the sweep for records no reply follows
        (expiries, disconnects). Raises nothing: a failure makes the journal not ``writable``
        (its grants go to ``refused``); while it is not, the records are dropped (``recover``
        writes every lease held)."""
        buf = self.buf
        if self._sync_error is not None:
            exc, self._sync_error = self._sync_error, None
            self._fail(exc, buf)
            buf.clear()
            return
        if not buf:
            return
        if not self.writable:
            buf.clear()
            return
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        fd = self._fd
        try:
            written = _write(fd, data)
            if written < len(data):  # a short write: a full disk, or a signal
                _write_all(fd, memoryview(data)[written:])
        except OSError as exc:
            # A disk full or failing: cut what part of the batch got in, so the file still
            # ends with a whole record.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._size)
            self._fail(exc, buf)
            buf.clear()
            return
        self._size += len(data)
        self._written += 1
        self.stats.writes += 1
        if self.fsync == "always" and self._must_sync:
            # A batch of renewals and releases only is written, not fsynced: within a boot
            # the file as the kernel has it is what a restart reads, and after a crash of the
            # machine no restore reads a renewal's end (each lease runs its full lease, at
            # least the longest recorded, fsynced before any longer lease is answered), and a
            # lost release only keeps a lease for one lease more.
            self._must_sync = False
            try:
                self._fsync_file(fd)
            except OSError as exc:
                self._fail(exc, buf)
                buf.clear()
                return
            self._synced = self._written
            self.stats.fsyncs += 1
        buf.clear()

    def sync(self) -> None:
        """fsync what was written (any thread; ``everysec``'s background step). Only an fsync
        that succeeds marks it synced; a failure is kept for the loop's next ``flush``."""
        with self._fd_lock:
            fd = self._fd
            if fd < 0:
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
        """``everysec``: fsync in a thread of its own when something was written and no fsync
        is under way (the loop never waits for the disk)."""
        if self.fsync != "everysec" or not self.dirty or self._syncing or not self.writable:
            return
        self._syncing = True

        def run() -> None:
            try:
                self.sync()
            except OSError as exc:
                log.error("journal: fsync of %s failed: %s", self.path, exc)
            finally:
                self._syncing = False

        threading.Thread(target=run, name="dflockd-journal-fsync", daemon=True).start()

    def wants_compaction(self, live: int) -> bool:
        """Whether the file holds mostly records of leases gone (then ``compact``): past
        ``COMPACT_MIN_BYTES``, and four times what its live grants would take."""
        size = self._size
        return size > COMPACT_MIN_BYTES and size > 4 * _LIVE_RECORD_BYTES * live

    def compact(self, live: Iterable[bytes]) -> None:
        """Rewrite the file with only ``live`` (the current grants, see ``grant_record``); a
        failure is a failure to write (the journal is then not ``writable``)."""
        self.flush()
        if not self.writable:
            return
        try:
            self._replace(live)
        except OSError as exc:
            self._fail(exc, [])
            return
        self.stats.compactions += 1

    def recover(self, live: Iterable[bytes]) -> bool:
        """Not ``writable``: try a new file holding ``live`` (every lease held now, so what
        was not recorded meanwhile is in it). True once the journal is writable again."""
        if self.writable:
            return True
        self.buf.clear()
        self._sync_error = None
        try:
            self._replace(live)
        except OSError:
            return False
        self.refused.clear()
        self.writable = True
        self.stats.writable = True
        self.mark_removed = True
        log.warning(
            "journal: %s can be written again (it could not: %s); granting again",
            self.path,
            self.failure,
        )
        self.failure = ""
        return True

    def close(self) -> None:
        """Write what is buffered, a graceful stop's ``C`` record, fsync, and close the file."""
        try:
            if self.writable:
                self.buf.append(_line("C"))
                self.flush()
                if self.writable:
                    self.sync()
        finally:
            with self._fd_lock:
                fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
