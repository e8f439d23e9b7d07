"""Reading the lease journal back (``journal`` writes it, and its module doc gives the format),
and what a start restores from it.

Restoring (``read_journal``, ``restored_leases``): every grant with no later ``R`` comes back.
How long it runs from the restart depends on what the file can prove:

- **same boot, complete journal** (the file's boot id is this boot's, and the ``complete`` mark
  beside it says every renewal answered is recorded): ``min(until - now, lease)``, ``now`` on
  the file's own clock (monotonic time elapsed since the anchor, immune to any wall-clock
  step). The restored end is the real end, or a few milliseconds after it (the end is rounded
  up to the next millisecond, and the restart reads the clock before it restores); a grant
  bound to a connection with an ``<onclose>`` lease runs at least that long (its connection
  closed with the old process).
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
record is lost (with ``always``, never a grant that was acknowledged; a renewal's record is not
read after a crash of the machine). Any other damage (a whole line that does
not check, two lines run together) means records after it are unknown: the caller then applies
a restart grace (``state``).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

__all__ = [
    "COMPLETE_SUFFIX",
    "VERSION",
    "JournalRead",
    "RecordedGrant",
    "Restore",
    "boot_id",
    "read_journal",
    "restored_leases",
]

VERSION = "2"
"""Written in the header; version 1 (no fsync field) is read too."""
COMPLETE_SUFFIX = ".complete"
"""The mark beside the journal: present while every renewal answered is in the file."""
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
