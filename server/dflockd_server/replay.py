"""Reading the lease journal back (``journal`` writes it; its module doc gives the format), and
what a start restores from it (as the operator sees it: docs/server.md, "What a start restores").

Every grant with no later ``R`` comes back, running from the restart:

- **same boot, complete journal** (the file's boot id is this boot's, and the ``complete`` mark
  says every renewal answered is recorded): ``until - now`` on the file's own monotonic clock,
  not capped at its lease (an earlier start may have restored it for longer); a grant bound to
  a connection with an ``<onclose>`` lease runs at least that long (its connection closed with
  the old process).
- **same boot, journal not complete**: ``max(its lease, the longest the run recorded)``: a
  renewal answered before the crash ended at most one such lease after it.
- **same boot, but the file may lack its last records** (the state dir mounted anew since, or a
  write failed before the previous run ended and the file's last page has left the page cache:
  ``pagecache``): as another boot's, grace included, unless a graceful stop fsynced the file.
- **another boot** (or an unreadable boot id): the wall clock may have been stepped, so each
  lease runs the longest of its own and the longest the run recorded; unless the file was
  fsynced at each reply (``always``) or closed by a graceful stop, its last records may be lost,
  so the start also grants nothing for that long (the restart grace, ``state``).

The restored end is never earlier than the real one: within a boot the file is read as the
kernel has it (a ``kill -9`` loses nothing written), and the ``complete`` mark is removed before
any renewal goes unrecorded. A start writes each restored grant's end as it restored it, and
`Restore.longest` (the start's lease bound) covers the time each was restored for.

The file is read a chunk at a time with the garbage collector paused (``paused_gc``); grants are
found by token through their fence (``recorded.RecordedGrants``); a batch (``K``) is checked with
one checksum, other lines all at once in C. A later header (``Journal.resume``) shifts the times
after it onto the first header's clock; one of another boot makes the whole file read as of
another boot. Reading stops at the first line that does not check: a last record without its
end of line is a torn tail (only that record is lost); any other damage leaves the records after
it unknown, and the caller applies a restart grace (``state``)."""

from __future__ import annotations

import contextlib
import gc
import math
import operator
import sys
import time
import zlib
from array import array
from collections.abc import Generator
from dataclasses import dataclass, field

from dflockd_server.recorded import RecordedGrant, RecordedGrants

VERSION = "3"  # written in the header; versions 1 (no fsync field) and 2 (no batches) are read too
COMPLETE_SUFFIX = ".complete"  # a mark: present while every renewal answered is in the journal
FREEZE_AFTER = 100_000  # objects made during a `paused_gc` from which they are frozen at its end
READ_CHUNK = 1 << 22
BATCH_BYTES = 1 << 20  # the most a batch (`K`) covers
BATCH_RECORDS = 16  # the fewest records a write puts in a batch
_BATCH_MARK = b" K "
_PAYLOAD = operator.itemgetter(slice(9, None))
_CHECKED = operator.itemgetter(slice(0, 9))  # a record line's checksum field and the space after it
_CRC_DIGITS = b"0123456789abcdef"
"""A checksum field's digits: ``int(field, 16)`` alone also takes a space, a sign, ``_``, ``0x``."""


@contextlib.contextmanager
def paused_gc() -> Generator[None]:
    """The cyclic garbage collector off while a start builds its million long-lived objects,
    then back as it was; if ``FREEZE_AFTER`` objects or more were made, they are frozen
    (``gc.freeze``) so no later collection scans them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_count()[0] >= FREEZE_AFTER:
            gc.freeze()
        if was:
            gc.enable()


def boot_id() -> str:
    """This boot of the machine (Linux's boot id), or ``-`` where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            text = fh.read().strip().replace("-", "")
    except OSError:
        return "-"
    return text or "-"


@dataclass(slots=True)
class JournalRead:
    """What ``read_journal`` found."""

    leases: RecordedGrants = field(default_factory=RecordedGrants)  # grants not released, by token
    anchor: tuple[str, int, int] | None = None  # clock anchor: boot id, wall ms, monotonic ms
    mount: int | None = None  # the state dir's mount (`pagecache`) in the last header (None: none)
    fsync: str = ""  # the `--journal-fsync` of the run that wrote it ("" for a version-1 file)
    clean: bool = False  # its last record is a graceful stop's (`C`, fsynced)
    records: int = 0
    dropped_bytes: int = 0  # bytes and lines from the first damaged line to the end of the file
    dropped_lines: int = 0
    damage: str = ""  # what was wrong with the first line that did not check ("" when none)
    torn_tail: bool = False  # the damage is a last record without its LF: a write cut short
    shift_ms: int = 0  # an `until` after the last header minus this is on the first header's clock

    @property
    def damaged_before_tail(self) -> bool:
        return bool(self.damage) and not self.torn_tail


def _apply(read: JournalRead, payload: str) -> str | None:
    """Apply a checked payload (a whole grant is ``_apply_lines``'); what is wrong, or None."""
    kind, _, rest = payload.partition(" ")
    leases = read.leases
    read.clean = False
    if kind == "R":
        leases.pop(rest)
    elif kind == "G":
        return "grant record with too few fields"
    elif kind == "X":
        token, lease, until = rest.split(" ")
        if (rec := leases.get(token)) is not None:
            rec.lease_ttl, rec.until_ms = int(lease), int(until) - read.shift_ms
    elif kind == "M":
        parts = rest.split(" ", 5)
        if len(parts) < 5:
            return "move record with too few fields"
        if (rec := leases.get(parts[0])) is not None:
            rec.detached = parts[1] == "d"
            rec.on_close = None if parts[2] == "-" else int(parts[2])
            rec.lease_ttl, rec.until_ms = int(parts[3]), int(parts[4]) - read.shift_ms
            rec.note = parts[5] if len(parts) > 5 else None
    elif kind == "N":
        token, _, note = rest.partition(" ")
        if (rec := leases.get(token)) is not None:
            rec.note = note or None
    elif kind == "H":
        parts = rest.split(" ")
        fields = 4 if parts[0] == "1" else 5 if parts[0] in ("2", VERSION) else 0
        if len(parts) != fields:
            return f"header of an unknown journal version ({rest[:40]!r})"
        boot, _, mount = parts[1].partition(".")
        anchor = (boot, int(parts[2]), int(parts[3]))
        read.mount = int(mount) if mount.isdigit() else None
        if (first := read.anchor) is None:
            read.anchor = anchor
        elif anchor[0] == first[0] != "-" and anchor[2] >= first[2]:
            # A restart on the same boot: shift by the difference of the anchors' offsets.
            read.shift_ms = (anchor[1] - anchor[2]) - (first[1] - first[2])
        else:
            # Not this server's (it appends only on the first header's boot): another boot.
            read.anchor = ("-", first[1], first[2])
            read.shift_ms = 0
        read.fsync = parts[4] if len(parts) == 5 else ""
    elif kind == "C":
        read.clean = True
    elif kind != "K":  # (a batch's head: its lines are checked one by one here)
        return f"unknown record kind {kind[:8]!r}"
    return None


def read_journal(path: str) -> JournalRead:
    """Read the journal at ``path`` up to its first damaged line. Raises ``OSError`` when the
    file cannot be read; a missing file reads as empty."""
    read = JournalRead()
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed below, around the whole read)
    except FileNotFoundError:
        return read
    with fh, paused_gc():
        start, size = 0, READ_CHUNK  # the file's offset of the chunk, the bytes read from it
        while True:
            # Each chunk from the first byte not used yet: no copies joining or cutting chunks.
            fh.seek(start)
            data = fh.read(size)
            at_end = len(data) < size
            end = len(data) if at_end else data.rfind(b"\n") + 1  # at the end: the tail too
            stop, used = _read_lines(read, data, end, at_end)
            if stop >= 0:
                rest = data[stop:] + fh.read()
                read.dropped_bytes = len(rest)
                read.dropped_lines = rest.count(b"\n") + (0 if rest.endswith(b"\n") else 1)
                read.torn_tail = b"\n" not in rest  # else a whole line that does not check
                break
            if at_end:
                break
            if used:
                start += used
                size = READ_CHUNK
            else:
                size *= 2  # a line or a batch longer than the chunk: read on until it ends
    return read


def _read_lines(read: JournalRead, data: bytes, size: int, at_end: bool) -> tuple[int, int]:
    """Apply the records of ``data[:size]``: ``(stop, used)``, ``stop`` the offset of the
    first line that does not check (its problem in ``read.damage``) or -1, ``used`` the bytes
    read (a batch that goes on past ``size`` is left for the next chunk). A batch that checks
    whole is read without checking each line; anything else is checked line by line."""
    pos = 0
    while pos < size:
        if (head := _next_batch(data, pos, size)) > pos:
            if (stop := _read_checked(read, data, pos, head)) >= 0:
                return stop, pos
            pos = head
            continue
        end = data.find(b"\n", pos, size)
        if (batch := _batch_of(data, pos, end)) is not None:
            crc, length = batch
            first, after = end + 1, end + 1 + length
            if after > size and not at_end:
                return -1, pos  # it goes on in the next chunk
            if (
                after <= size
                and data[after - 1 : after] == b"\n"
                and zlib.crc32(memoryview(data)[first:after]) == crc
            ):
                text = ""
                with contextlib.suppress(UnicodeDecodeError):
                    text = str(memoryview(data)[first:after], "utf-8")  # (no copy of the bytes)
                if text:
                    read.records += 1  # the K line
                    if (n := _apply_lines(read, text.split("\n"))) >= 0:
                        return _line_start(data[first:after].split(b"\n"), first, n), pos
                    pos = after
                    continue
        # A K line or batch that does not check, or a batch cut short: line by line.
        return _read_checked(read, data, pos, size), size
    return -1, size


def _next_batch(data: bytes, pos: int, size: int) -> int:
    """The offset of the first line in ``data[pos:size]`` that looks like a ``K`` line, or
    ``size`` (a note may hold ``" K "``: a hit mid-line is passed over)."""
    at = pos
    while True:
        if (hit := data.find(_BATCH_MARK, at, size)) < 0:
            return size
        start = hit - 8
        if start == pos or (start > pos and data[start - 1 : start] == b"\n"):
            return start
        at = hit + 1


def _batch_of(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """The checksum and length of the batch whose ``K`` line is ``data[pos:end]``, or ``None``."""
    if end < 0 or _line_problem(line := data[pos:end]) is not None:
        return None
    fields = line[9:].split(b" ")
    if (
        len(fields) != 3
        or len(fields[1]) != 8
        or fields[1].translate(None, _CRC_DIGITS)
        or not fields[2].isdigit()
        or len(fields[2]) > len(str(BATCH_BYTES))
        or int(fields[2]) > BATCH_BYTES
    ):
        return None
    return int(fields[1], 16), int(fields[2])


def _read_checked(read: JournalRead, data: bytes, start: int, end: int) -> int:
    """Apply the records of ``data[start:end]``, each line's checksum checked (all at once in
    C; a run that does not check whole is read again by ``_read_slowly`` to name its first bad
    line); the offset of the first line that does not check, or -1."""
    run = data[start:end]
    lines = run.split(b"\n")
    text = None
    if not lines.pop() and _checksums_hold(lines):  # (else a last line without its LF, or bad)
        with contextlib.suppress(UnicodeDecodeError):
            text = run.decode()
    if text is None:
        stop = _read_slowly(read, run)
        return -1 if stop < 0 else start + stop
    n = _apply_lines(read, text.split("\n"))
    return -1 if n < 0 else _line_start(lines, start, n)


def _line_start(lines: list[bytes], start: int, n: int) -> int:
    """The offset of line ``n`` of ``lines`` (split at each LF of the bytes at ``start``)."""
    return start + sum(map(len, lines[:n])) + n


def _apply_lines(read: JournalRead, texts: list[str]) -> int:
    """Apply the checked record lines ``texts`` (the last, empty piece is no record): the
    index of the first one that does not parse (its problem in ``read.damage``), or -1."""
    texts.pop()
    leases = read.leases
    shift = read.shift_ms
    for n, line in enumerate(texts):
        try:
            parts = line.split(" ", 10)
            if parts[1] == "G" and len(parts) >= 10:  # a grant: ``_apply``'s, inlined
                token = parts[2]
                limit = parts[4]
                on_close = parts[9]
                leases.put(
                    RecordedGrant(
                        token,
                        parts[3],
                        1 if limit == "1" else int(limit),
                        parts[5] == "1",
                        int(parts[6]),
                        int(parts[7]) - shift,
                        parts[8] == "d",
                        None if on_close == "-" else int(on_close),
                        parts[10] if len(parts) > 10 else None,
                    )
                )
                read.clean = False
                problem = None
            else:
                problem = _apply(read, line[9:])
                shift = read.shift_ms  # a header moves it
        except (ValueError, IndexError) as exc:
            problem = f"a record that does not parse ({exc})"
        if problem is not None:
            read.damage = problem
            read.records += n
            return n
    read.records += len(texts)
    return -1


def _checksums_hold(lines: list[bytes]) -> bool:
    """Whether every line is its payload's checksum (8 lowercase hex digits), a space and the
    payload, checked in C over all the lines' first 9 bytes joined."""
    fields = b"".join(map(_CHECKED, lines))
    n = len(lines)
    if len(fields) != 9 * n or fields[8::9] != b" " * n:
        return False
    if fields.translate(None, _CRC_DIGITS + b" ") or fields.count(b" ") != n:
        return False
    sums = array("I", map(zlib.crc32, map(_PAYLOAD, lines)))
    if sys.byteorder == "little":
        sums.byteswap()
    return sums.tobytes() == bytes.fromhex(fields.decode())


def _line_problem(line: bytes) -> str | None:
    """What is wrong with ``line`` (without its LF) as a record line (its checksum field and
    the CRC-32 of its payload), or ``None``."""
    if len(line) < 10 or line[8:9] != b" " or line[:8].translate(None, _CRC_DIGITS):
        return "a line that is not a record"
    if int(line[:8], 16) != zlib.crc32(line[9:]):
        return "a record whose checksum does not match"
    return None


def _read_slowly(read: JournalRead, data: bytes) -> int:
    """``_read_lines``, a line at a time."""
    pos, size = 0, len(data)
    while pos < size:
        if (end := data.find(b"\n", pos)) < 0:
            read.damage = "a record without its end of line (a write cut short)"
            return pos
        line = data[pos:end]
        if (problem := _line_problem(line)) is not None:
            read.damage = problem
            return pos
        try:
            payload = line[9:].decode()
        except UnicodeDecodeError as exc:
            read.damage = f"a record that does not parse ({exc})"
            return pos
        if _apply_lines(read, [line[:9].decode() + payload, ""]) >= 0:
            return pos
        pos = end + 1
    return -1


@dataclass(frozen=True, slots=True)
class Restore:
    """What ``restored_leases`` makes of a journal."""

    leases: list[RecordedGrant]  # the grants still running, each with its seconds `left`
    how: str  # which rule gave their time left, for the start-up log
    grace_s: float  # seconds the start grants nothing (0: none)
    exact: bool = False
    """Each lease runs to its recorded end (same boot, complete journal): a start may go on
    appending to the file as it is."""
    ended: list[str] = field(default_factory=lambda: [])
    """Tokens of the grants whose lease ended before the restart (with ``exact``)."""
    longest: int = 0
    """The longest lease among ``leases`` (its own, its ``<onclose>`` lease, or the time it was
    restored for, whole seconds up), 0 when none."""


def restored_leases(
    read: JournalRead,
    *,
    complete: bool = True,
    run_longest: int = 0,
    tail_lost: str = "",
    monotonic_ms: int | None = None,
    this_boot: str | None = None,
) -> Restore:
    """The grants of ``read`` still running now, each with its seconds ``left`` (the rules: the
    module's doc). ``run_longest``: the longest lease its run recorded, 0 when unknown;
    ``tail_lost``: why the file may lack its last records on this boot, "" when it cannot. The
    clock arguments are for tests (nothing trusts the wall clock)."""
    mono = time.monotonic_ns() // 1_000_000 if monotonic_ms is None else monotonic_ms
    boot = boot_id() if this_boot is None else this_boot
    anchor = read.anchor
    same_boot = anchor is not None and anchor[0] != "-" and anchor[0] == boot and mono >= anchor[2]
    lost_tail = same_boot and bool(tail_lost) and not read.clean
    out: list[RecordedGrant] = []
    grace = 0.0
    if anchor is None:  # not even a whole header: the file was never a run's journal
        return Restore(out, "the journal holds no header: nothing was recorded in it", grace)
    if same_boot and complete and not lost_tail:
        now = anchor[1] + (mono - anchor[2])  # the file's own clock: no wall-clock step
        how = "same boot: each lease until its recorded end, on the monotonic clock"
        ended: list[str] = []
        append = out.append
        longest = 0
        for rec in read.leases.values():
            on_close = rec.on_close
            lease_ttl = rec.lease_ttl
            # Not capped at its lease: an earlier start may have restored it for longer.
            left = (rec.until_ms - now) / 1000.0
            if on_close is not None and not rec.detached and left < on_close:
                left = float(on_close)  # its connection closed with the process
            if left > 0:
                rec.left = left
                append(rec)
                if lease_ttl > longest:  # noqa: PLR1730 (no call of max: once per lease)
                    longest = lease_ttl
                if on_close is not None and on_close > longest:
                    longest = on_close
                if left > longest:
                    longest = math.ceil(left)
            else:
                ended.append(rec.token)
        return Restore(out, how, grace, exact=True, ended=ended, longest=longest)
    durable = complete and (read.clean or read.fsync == "always")
    each = f"each lease for the longest of its own and {run_longest} s from now"
    no_grant = ", and no grant until then (records of the last moments may be lost)"
    if lost_tail:
        how = f"the same boot, but {tail_lost}: {each}" + ("" if durable else no_grant)
        grace = 0.0 if durable else float(run_longest)
    elif same_boot:
        how = (
            "same boot, but the journal may lack renewals (answered while it could not be "
            f"written): {each}"
        )
    elif durable:
        how = (
            "another boot (the wall clock is not trusted across a boot): each lease for the "
            f"longest of its own and {run_longest} s (the longest the run recorded) from now"
        )
    else:
        how = (
            "another boot (the wall clock is not trusted across a boot), and the journal was "
            + (
                "not fsynced at each reply"
                if complete
                else "not complete (renewals answered while it could not be written)"
            )
            + f": {each}{no_grant}"
        )
        grace = float(run_longest)
    out = read.leases.values()
    longest = 0
    for rec in out:
        told = max(rec.lease_ttl, rec.on_close or 0, run_longest)
        longest = max(longest, told)  # what its holder may have been told: the new bound
        rec.left = float(told)
        grace = max(grace, rec.left) if grace else grace
    return Restore(out, how, grace, longest=longest)
