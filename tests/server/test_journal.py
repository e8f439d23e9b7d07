"""The lease journal (issue 26): its records and the restore rule without I/O, a real server
restoring what it recorded, and a journal cut or damaged anywhere (acceptance 3)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import re
import resource
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import replay
from dflockd_server.config import Config, ConfigError
from dflockd_server.journal import Journal
from dflockd_server.net import Server
from dflockd_server.replay import (
    BATCH_BYTES,
    COMPLETE_SUFFIX,
    FREEZE_AFTER,
    Restore,
    paused_gc,
    read_journal,
    restored_leases,
)
from dflockd_server.state import StateDir, default_state_dir, resolve_state_dir
from dflockd_server.table import Holder, LockTable, Waiter
from dflockd_server.testing import ServerThread
from tests.support.clock import FakeClock as Clock
from tests.support.servers import dflockd_subprocess
from tests.support.tables import by_token, recorded, tokens_of
from tests.support.waiting import wait_until
from tests.support.wire import Wire, fence

LEASE = 60


def config(state_dir: Path, **overrides: Any) -> Config:
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "state_dir": str(state_dir)}
    return Config(**{**settings, **overrides})


# ---------------------------------------------------------------- records and the restore rule
def line(payload: str) -> bytes:
    return b"%08x %s\n" % (zlib.crc32(payload.encode()), payload.encode())


def journal_bytes(
    *payloads: str,
    boot: str = "b00t",
    wall_ms: int = 1_000_000,
    mono_ms: int = 500,
    fsync: str = "everysec",
) -> bytes:
    header = f"H 3 {boot} {wall_ms} {mono_ms} {fsync}"
    return line(header) + b"".join(line(p) for p in payloads)


def write(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "journal"
    path.write_bytes(data)
    return str(path)


def test_grants_without_a_release_are_read_with_their_fields(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        journal_bytes(
            "G aaaa k1 1 0 20 1040000 c -",
            "G bbbb s1 3 1 30 1050000 d - owner note with spaces",
            "G cccc k2 1 0 20 1040000 c 15",
            "R aaaa",
            "N cccc run-7",
        ),
    )
    read = read_journal(path)
    assert not read.damage
    assert sorted(tokens_of(read.leases)) == ["bbbb", "cccc"]
    sem = by_token(read.leases)["bbbb"]
    assert (sem.key, sem.limit, sem.is_sem, sem.lease_ttl, sem.detached, sem.note) == (
        "s1",
        3,
        True,
        30,
        True,
        "owner note with spaces",
    )
    held = by_token(read.leases)["cccc"]
    assert (held.on_close, held.note, held.detached) == (15, "run-7", False)


@pytest.mark.parametrize(
    ("header", "damage"),
    [
        ("H 1 b00t 1000000 500", ""),
        ("H 2 b00t 1000000 500 everysec", ""),
        ("H 3 b00t 1000000 500 everysec", ""),
        ("H 4 b00t 1000000 500 everysec", "header of an unknown journal version"),
        ("H 3 b00t 1000000 500", "header of an unknown journal version"),
    ],
)
def test_the_versions_of_the_header_read_are_the_three_written_so_far(
    tmp_path: Path, header: str, damage: str
) -> None:
    read = read_journal(write(tmp_path, line(header) + line("G aaaa k 1 0 20 1040000 c -")))
    assert read.damage.startswith(damage) and bool(read.damage) == bool(damage)
    assert tokens_of(read.leases) == ([] if damage else ["aaaa"])


def test_on_the_same_boot_a_lease_comes_back_until_its_recorded_end(tmp_path: Path) -> None:
    # Recorded until 1_040_000 ms (40 s after the anchor), lease 20 s: an end past one lease
    # from now is one an earlier start restored it to (its holder may have been told so).
    read = read_journal(write(tmp_path, journal_bytes("G aaaa k 1 0 20 1040000 c -")))
    at_once = restored_leases(read, monotonic_ms=500, this_boot="b00t")
    assert at_once.leases[0].left == pytest.approx(40.0)
    assert at_once.longest == 40  # the start's lease bound covers it
    later = restored_leases(read, monotonic_ms=30_500, this_boot="b00t")
    assert later.leases[0].left == pytest.approx(10.0)
    assert later.longest == 20
    assert restored_leases(read, monotonic_ms=40_500, this_boot="b00t").leases == []
    assert at_once.grace_s == later.grace_s == 0


def _restarted(path: str, restore: Restore, mono_ms: int, boot: str) -> None:
    """What a start does with ``restore`` before it serves: the table takes its grants, and a
    new journal file holds them (then the start stops; its ``complete`` mark stays)."""
    table = LockTable(clock=lambda: 0.0, new_token=lambda: "0" * 32, max_locks=10)
    table.restore_all(restore.leases)
    clocks = (1_000_000 + mono_ms, mono_ms, boot)
    journal = Journal(path, "everysec", lambda: 0.0, clocks=lambda: clocks)
    journal.anchor()
    live = table.live_holders()
    journal.open(
        journal.grant_record(held, slot, held.client is table.grants.detached, on_close)
        for held, slot, on_close in live
    )
    journal.close()


@pytest.mark.parametrize("first_boot", ["b00t", "earlier"])
def test_a_grant_restored_for_longer_than_its_lease_keeps_that_time_at_the_next_restart(
    tmp_path: Path, first_boot: str
) -> None:
    """A 30 s grant renewed to 300 s (`n k <token> 300`) while the journal could not record it
    (or lost on a machine's crash) comes back for the run's longest lease, 300 s: its holder
    was told so. The start writes it to its own journal with its own lease, 30 s, and that
    restored end; the restart after it (same boot, journal complete) cut it back to 30 s, and a
    start after a reboot had a bound of 30 s: either way the key was free while its holder
    held it."""
    first = tmp_path / "first"
    first.mkdir()
    path = write(first, journal_bytes("G aaaa k 1 0 30 1030000 c -", boot=first_boot))
    # The holder's renewal to 300 s at 19 s was answered and not recorded.
    restore = restored_leases(
        read_journal(path),
        complete=False,
        run_longest=300,
        monotonic_ms=20_500,
        this_boot="b00t",
    )
    assert restore.leases[0].left == 300.0
    assert restore.longest == 300  # the start's lease bound: not the grant's own 30 s
    journal = str(tmp_path / "journal")
    _restarted(journal, restore, 20_500, "b00t")
    assert os.path.exists(journal + COMPLETE_SUFFIX)
    again = restored_leases(
        read_journal(journal), run_longest=restore.longest, monotonic_ms=30_500, this_boot="b00t"
    )
    assert again.exact
    # 10 s after the start (it was 30.0; the record's end is in whole milliseconds, up)
    assert again.leases[0].left == pytest.approx(290.0, abs=0.01)
    assert again.longest == 291
    rebooted = restored_leases(
        read_journal(journal), run_longest=restore.longest, this_boot="after-a-reboot"
    )
    assert rebooted.leases[0].left == 300.0


def test_a_restore_says_its_longest_lease_and_raises_the_fence_above_every_token(
    tmp_path: Path,
) -> None:
    """What a start records before it serves (the longest lease restored, ``<onclose>``
    included) and the fence it raises its counter above (the largest token's) are found in
    the restore's own passes (issue 52), under both rules; a token of another width is read
    on its own (the largest string of the usual width is the largest fence only among them)."""
    high = f"{9:016x}{0:016x}"
    grants = [
        f"G {f'{5:016x}{7:016x}'} a 1 0 20 1040000 c -",
        f"G {high} b 1 0 30 1040000 c 45",  # its connection's close leaves it 45 s
        "G ff c 1 0 10 1040000 d -",  # fence 255, above the others: not read as a string
        f"G {f'{3:016x}{9:016x}'} d 1 0 60 1040000 c -",
    ]
    read = read_journal(write(tmp_path, journal_bytes(*grants, "R " + grants[3].split()[1])))
    same_boot = restored_leases(read, monotonic_ms=500, this_boot="b00t")
    assert same_boot.exact and same_boot.longest == 45
    other_boot = restored_leases(read, run_longest=100, monotonic_ms=500, this_boot="elsewhere")
    assert not other_boot.exact and other_boot.longest == 100  # each restored for the run's
    table = LockTable(clock=lambda: 0.0, new_token=lambda: "0" * 32, max_locks=10)
    restored, highest, refused = table.restore_all(same_boot.leases)
    assert (restored, highest, refused) == (3, 255, [])
    table = LockTable(clock=lambda: 0.0, new_token=lambda: "0" * 32, max_locks=10)
    usual = restored_leases(read, monotonic_ms=500, this_boot="b00t").leases
    assert table.restore_all([r for r in usual if r.token != "ff"])[1] == 9


def test_a_restored_lease_ends_at_its_own_end_when_an_earlier_grant_was_renewed_past_it(
    tmp_path: Path,
) -> None:
    """The journal lists grants in grant order, and a renewal (``X``) moves a grant's end but
    not its place: two grants of one lease length come back in an order that is not the order
    of their ends. The second one still ends at its own end, and its waiter is granted then,
    not when the first one's renewed lease ends (the expiry index is read in end order)."""
    read = read_journal(
        write(
            tmp_path,
            journal_bytes(
                "G aaaa first 1 0 20 1020000 c -",  # until 20 s after the anchor
                "G aaab second 1 0 20 1021000 c -",  # until 21 s (the next fence)
                "X aaaa 20 1035000",  # the first renewed: until 35 s
            ),
        )
    )
    # Restarted 15 s after the anchor: the first has 20 s left, the second 6 s (and comes
    # second: the table puts it first).
    got = restored_leases(read, monotonic_ms=15_500, this_boot="b00t")
    assert [(r.key, r.left) for r in got.leases] == [("first", 20.0), ("second", 6.0)]
    clock = Clock()
    table = LockTable(clock=clock, new_token=lambda: "0" * 32, max_locks=10)
    assert table.restore_all(got.leases)[0] == 2
    waiter = table.acquire(table.open_client(), "second", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter) and waiter.holder is None
    clock.now = 5.9
    assert table.expire() == 0 and waiter.holder is None
    clock.now = 6.1
    assert table.expire() == 1, "the second lease did not end at its own end"
    assert waiter.holder is not None and waiter.holder.key == "second"
    assert table.is_busy("first")  # its renewed lease runs on
    clock.now = 20.1
    assert table.expire() == 1 and not table.is_busy("first")


def test_after_a_reboot_a_grant_with_an_onclose_lease_does_not_hold_back_a_later_ones_end(
    tmp_path: Path,
) -> None:
    """The other-boot rule gives each grant a full lease from the restart, an ``<onclose>``
    lease if it is longer: an earlier grant of one lease length may end later than the next
    one, which still ends at its own end."""
    read = read_journal(
        write(
            tmp_path,
            journal_bytes(
                "G aaaa first 1 0 20 1020000 c 45",  # its connection's close leaves it 45 s
                "G aaab second 1 0 20 1021000 c -",
            ),
        )
    )
    got = restored_leases(read, run_longest=20, monotonic_ms=500, this_boot="elsewhere")
    assert [(r.key, r.left) for r in got.leases] == [("first", 45.0), ("second", 20.0)]
    clock = Clock()
    table = LockTable(clock=clock, new_token=lambda: "0" * 32, max_locks=10)
    assert table.restore_all(got.leases)[0] == 2
    clock.now = 20.1
    assert table.expire() == 1 and not table.is_busy("second") and table.is_busy("first")


def wall_clock_at(monkeypatch: pytest.MonkeyPatch, wall_ms: int) -> None:
    """The process's wall clock reads ``wall_ms`` (the journal's header says 1,000,000)."""
    monkeypatch.setattr(time, "time", lambda: wall_ms / 1000)
    monkeypatch.setattr(time, "time_ns", lambda: wall_ms * 1_000_000)


def test_on_the_same_boot_the_files_own_clock_counts_not_a_wall_clock_that_jumped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = read_journal(write(tmp_path, journal_bytes("G aaaa k 1 0 20 1040000 c -")))
    for wall_ms in (1_600_000, 400_000):  # the wall clock 10 minutes ahead, or behind
        wall_clock_at(monkeypatch, wall_ms)
        kept = restored_leases(read, monotonic_ms=30_500, this_boot="b00t")
        assert kept.leases[0].left == pytest.approx(10.0)  # 30 s passed on the monotonic clock


@pytest.mark.parametrize("wall_ms", [1_600_000, 400_000, 1_000_000])
def test_after_a_reboot_every_lease_runs_its_full_lease_whatever_the_wall_clock(
    tmp_path: Path, wall_ms: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47: the wall clock is not trusted across a boot (the review's reboot with the
    clock 600 s ahead restored nothing). A journal fsynced at each reply restores each lease
    for a full lease (at least the longest the run recorded); one that was not also holds every
    grant back for the longest lease."""
    wall_clock_at(monkeypatch, wall_ms)
    records = ("G aaaa k 1 0 20 1040000 c -", "G bbbb h 1 0 30 1050000 d 45")
    always = read_journal(write(tmp_path, journal_bytes(*records, fsync="always")))
    got = restored_leases(always, run_longest=40, monotonic_ms=1, this_boot="x")
    assert {r.key: r.left for r in got.leases} == {"k": 40.0, "h": 45.0}
    assert got.grace_s == 0 and "another boot" in got.how
    everysec = read_journal(write(tmp_path, journal_bytes(*records, fsync="everysec")))
    got = restored_leases(everysec, run_longest=60, monotonic_ms=1, this_boot="x")
    assert [r.left for r in got.leases] == [60.0, 60.0]
    assert got.grace_s == 60.0 and "no grant until then" in got.how
    clean = read_journal(write(tmp_path, journal_bytes(*records, "C", fsync="everysec")))
    got = restored_leases(clean, run_longest=40, monotonic_ms=1, this_boot="x")
    assert {r.key: r.left for r in got.leases} == {"k": 40.0, "h": 45.0} and got.grace_s == 0


def test_a_journal_without_its_complete_mark_restores_the_longest_lease_from_now(
    tmp_path: Path,
) -> None:
    """Renewals answered while the journal could not be written are not in it: the restored
    end must not come before theirs, whatever the recorded ``until`` says."""
    read = read_journal(write(tmp_path, journal_bytes("G aaaa k 1 0 20 1001000 c -")))
    got = restored_leases(
        read, complete=False, run_longest=33, monotonic_ms=30_500, this_boot="b00t"
    )
    assert [r.left for r in got.leases] == [33.0] and got.grace_s == 0


def test_a_header_names_the_mount_it_was_written_on_and_a_later_header_the_last_one(
    tmp_path: Path,
) -> None:
    """``<boot id>.<mount id>``: the boot is compared as before (a header without a mount, as
    older versions wrote it, reads as it did), the mount of the last header is the file's."""
    data = journal_bytes("G aaaa k1 1 0 20 1040000 c -", boot="b00t.41")
    data += line("H 3 b00t.57 1001000 1500 everysec") + line("G bbbb k2 1 0 20 1030000 c -")
    read = read_journal(write(tmp_path, data))
    assert not read.damage and read.anchor == ("b00t", 1_000_000, 500) and read.mount == 57
    assert restored_leases(read, monotonic_ms=500, this_boot="b00t").exact
    old = read_journal(write(tmp_path, journal_bytes("G aaaa k1 1 0 20 1040000 c -")))
    assert old.mount is None and restored_leases(old, monotonic_ms=500, this_boot="b00t").exact


@pytest.mark.parametrize(
    ("fsync", "clean", "complete", "grace"),
    [
        ("everysec", False, True, 33.0),  # the last second of grants may be gone: wait them out
        ("always", False, True, 0.0),  # every grant was fsynced before its reply
        ("always", False, False, 33.0),  # and renewals went unrecorded meanwhile
        ("everysec", True, True, None),  # a graceful stop fsynced it all: read as it is
    ],
)
def test_a_journal_on_a_file_system_mounted_anew_is_read_as_a_crash_of_the_machine_leaves_it(
    tmp_path: Path, fsync: str, clean: bool, complete: bool, grace: float | None
) -> None:
    """The same boot, but the state dir's file system was mounted anew since the file was
    written (``tail_lost``, ``pagecache``): what the kernel had not yet put on the disk is gone,
    so the restore is another boot's (each lease for the longest recorded, and a grace where a
    lost grant could still run), unless a graceful stop (``C``) fsynced the file."""
    records = ["G aaaa k 1 0 20 1040000 c -", *(["C"] if clean else [])]
    read = read_journal(write(tmp_path, journal_bytes(*records, fsync=fsync)))
    got = restored_leases(
        read,
        complete=complete,
        run_longest=33,
        tail_lost="the state dir's file system was mounted anew",
        monotonic_ms=30_500,
        this_boot="b00t",
    )
    if grace is None:
        assert got.exact and [r.left for r in got.leases] == [pytest.approx(10.0)]
        return
    assert not got.exact and [r.left for r in got.leases] == [33.0]
    assert got.grace_s == grace and "mounted anew" in got.how


def test_moves_and_extensions_change_what_comes_back(tmp_path: Path) -> None:
    read = read_journal(
        write(
            tmp_path,
            journal_bytes(
                "G aaaa k 1 0 20 1040000 c -",
                "X aaaa 25 1080000",
                "M aaaa d - 40 1100000 taken-over",
            ),
        )
    )
    (rec,) = read.leases.values()
    assert (rec.lease_ttl, rec.until_ms, rec.detached, rec.note) == (
        40,
        1_100_000,
        True,
        "taken-over",
    )


def test_a_cut_last_record_is_a_torn_tail_and_damage_before_it_is_not(tmp_path: Path) -> None:
    whole = journal_bytes("G aaaa k1 1 0 20 1040000 c -", "G bbbb k2 1 0 20 1040000 c -")
    torn = read_journal(write(tmp_path, whole[:-5]))
    assert torn.torn_tail and not torn.damaged_before_tail
    assert tokens_of(torn.leases) == ["aaaa"]
    flipped = bytearray(whole)
    flipped[whole.index(b"k1") + 1] ^= 0x01
    damaged = read_journal(write(tmp_path, bytes(flipped)))
    assert damaged.damaged_before_tail and damaged.dropped_lines == 2
    assert tokens_of(damaged.leases) == []


def test_two_last_records_run_together_are_damage_not_a_torn_tail(tmp_path: Path) -> None:
    """A lost end of line (a flipped byte, not a write cut short) merges the last two records
    into one line that does not check: a record before the tail is lost, so it counts as
    damage (the caller waits out a grace), not as a torn tail."""
    whole = journal_bytes("G aaaa k1 1 0 20 1040000 c -", "G bbbb k2 1 0 20 1040000 c -")
    merged = bytearray(whole)
    merged[whole.index(b"\n", whole.index(b"G aaaa"))] = ord(" ")
    read = read_journal(write(tmp_path, bytes(merged)))
    assert read.damage and not read.torn_tail and read.damaged_before_tail
    assert tokens_of(read.leases) == []


@pytest.mark.parametrize("spoiled", [b" ", b"\r", b"+", b"upper"])
def test_a_checksum_field_that_is_not_8_lowercase_hex_digits_is_damage(
    tmp_path: Path, spoiled: bytes
) -> None:
    """A flipped byte in a record's checksum field that leaves the number the same (a leading
    0 turned into a space, a carriage return or a sign; a hex letter turned upper case) is
    damage like any other: ``int(field, 16)`` alone read those as the right checksum, so the
    reader went on past a damaged line (the flipped-bytes test below caught it, about once in
    ten runs: its random journal's checksums differ from run to run)."""
    grants = [f"G a{n} k{n} 1 0 20 1040000 c -" for n in range(400)]
    whole = journal_bytes(*grants, "G last kz 1 0 20 1040000 c -")
    lines = whole.split(b"\n")
    digit = b"0" if spoiled != b"upper" else b"abcdef"
    at = next(i for i, raw in enumerate(lines[1:-2], 1) if raw[:1] in digit)
    spoilt = lines[at][:1].upper() if spoiled == b"upper" else spoiled
    lines[at] = spoilt + lines[at][1:]
    read = read_journal(write(tmp_path, b"\n".join(lines)))
    assert read.damage == "a line that is not a record", read.damage
    assert read.damaged_before_tail and read.records == at
    assert (
        len(read.leases.values()) == at - 1
    )  # the grants before it (the first line is the anchor)


def test_a_checksum_field_with_its_space_moved_is_damage_even_when_its_digits_match(
    tmp_path: Path,
) -> None:
    """The reader checks a chunk's checksum fields all at once, read as hex (issue 52): that
    reading skips spaces between two digits, so a field ``ab cdef01`` followed at once by a
    payload whose checksum is ``abcdef01`` read as the right checksum. A record is its 8 digits,
    then a space: that line is damage, as the reader a line at a time says."""
    grants = [f"G a{n} k{n} 1 0 20 1040000 c -" for n in range(50)]
    lines = journal_bytes(*grants).split(b"\n")
    payload = b"G moved km 1 0 20 1040000 c -"
    digits = b"%08x" % zlib.crc32(payload)
    at = 20
    lines[at] = digits[:2] + b" " + digits[2:] + payload
    read = read_journal(write(tmp_path, b"\n".join(lines)))
    assert read.damage == "a line that is not a record", read.damage
    assert read.damaged_before_tail and read.records == at
    assert read.leases.get("moved") is None and len(read.leases.values()) == at - 1


def test_the_default_state_dir_is_per_address_and_port_0_has_none() -> None:
    env = {"HOME": "/home/u"}
    assert (
        default_state_dir("127.0.0.1", 6388, env) == "/home/u/.local/state/dflockd/127.0.0.1-6388"
    )
    assert default_state_dir("::1", 7000, {"XDG_STATE_HOME": "/s"}) == "/s/dflockd/__1-7000"
    assert resolve_state_dir(Config(host="127.0.0.1", port=0), env) is None
    assert resolve_state_dir(Config(host="127.0.0.1", port=6388, state_dir="none"), env) is None
    assert (
        resolve_state_dir(Config(host="h", port=6388), env) == "/home/u/.local/state/dflockd/h-6388"
    )


def test_a_second_server_on_one_state_dir_refuses_to_start_and_says_why(tmp_path: Path) -> None:
    first = StateDir(str(tmp_path))
    first.open()
    try:
        with pytest.raises(ConfigError, match=r"--state-dir .*another dflockd \(pid \d+\)"):
            StateDir(str(tmp_path)).open()
    finally:
        first.close()
    again = StateDir(str(tmp_path))
    again.open()  # free once the first let go
    again.close()


# ---------------------------------------------------------------- a real server
def stopped_while_held(server: ServerThread, *requests: tuple[str, str, str]) -> list[str]:
    """Send ``requests`` (each must be granted), then stop the server while the connection
    still holds what they got, as a crash would; the tokens."""
    with Wire(server.address) as a:
        tokens = [a.req(*request).split()[1] for request in requests]
        server.stop()
    return tokens


def test_a_restart_restores_locks_slots_and_holds_and_fences_keep_rising(tmp_path: Path) -> None:
    server = ServerThread(config(tmp_path)).start()
    keep_port = server.port
    lock, slot, hold = stopped_while_held(
        server,
        ("l", "k", f"0 {LEASE}"),
        ("sl", "s", f"0 3 {LEASE}"),
        ("hl", "q", f"0 {LEASE} d task-1"),
    )
    with ServerThread(config(tmp_path, port=keep_port)) as again, Wire(again.address) as b:
        stats = again.stats()
        assert stats["journal"]["restored"] == 3
        entries = {e["key"]: e for e in stats["locks"]}
        assert entries["k"]["restored"] is True and entries["q"]["restored"] is False
        assert entries["q"]["owner"] == "task-1" and entries["q"]["detached"] is True
        assert 0 < entries["k"]["lease_expires_in_s"] <= LEASE
        assert b.req("l", "k", "0") == "timeout"  # a rival waits for the restored lease
        assert b.req("sl", "s", f"0 3 {LEASE}").startswith("ok ")  # a free slot is granted
        assert b.req("n", "k", f"{lock} {LEASE}") == f"ok {LEASE}"  # renewed by token
        assert b.req("sn", "s", f"{slot} {LEASE}") == f"ok {LEASE}"
        assert b.req("r", "q", hold) == "ok"
        free = b.lock("free")
        assert fence(free) > max(fence(lock), fence(slot), fence(hold))


def test_each_record_a_server_writes_is_its_payload_framed_as_the_format_says(
    tmp_path: Path,
) -> None:
    """The records as bytes: every line is ``line(payload)`` (this file's own framing: the
    CRC-32 of the payload's UTF-8 as %08x, a space, the payload, LF), and each grant's payload
    has the documented fields, for a lock, a semaphore slot, a detached hold and a bound one
    with their notes, the detached one taken over with a close lease, and a release. Then a
    burst of pipelined grants: each write of 16 records or more is a batch, headed by a ``K``
    line with the CRC-32 and the length of the whole lines that follow it."""
    burst = 200
    with (
        ServerThread(config(tmp_path, max_locks_per_connection=0)) as srv,
        Wire(srv.address) as wire,
    ):
        lock = wire.req("l", "k", f"0 {LEASE}").split()[1]
        slot = wire.req("sl", "s", f"0 3 {LEASE}").split()[1]
        hold = wire.req("hl", "q", f"0 {LEASE} d task-1@w1").split()[1]
        bound = wire.req("hl", "c", f"0 {LEASE} c run-2").split()[1]
        assert wire.req("ht", "q", f"{hold} {LEASE} 45 task-1@w2") == f"ok {LEASE}"
        assert wire.req("r", "k", lock) == "ok"
        wire.send_raw(b"".join(b"l\nb%d\n0 %d\n" % (i, LEASE) for i in range(burst)))
        burst_tokens = [wire.recv().split()[1] for _ in range(burst)]
        journal = next(path for path in (tmp_path).rglob("*journal*") if path.is_file())
        raw = journal.read_bytes()
    records = raw.splitlines(keepends=True)
    payloads = [record[9:-1].decode() for record in records]
    assert records == [line(payload) for payload in payloads]
    until = r"\d+"
    lease = LEASE
    expected = [
        r"H 3 \S+ \d+ \d+ everysec",
        rf"G {lock} k 1 0 {lease} {until} c -",
        rf"G {slot} s 3 1 {lease} {until} c -",
        rf"G {hold} q 1 0 {lease} {until} d - task-1@w1",
        rf"G {bound} c 1 0 {lease} {until} c - run-2",
        rf"M {hold} c 45 {lease} {until} task-1@w2",
        rf"R {lock}",
    ]
    for payload, pattern in zip(payloads, expected, strict=False):
        assert re.fullmatch(pattern, payload), (payload, pattern)
    # The burst: its grants in order, each batch's K line covering exactly the lines after it.
    rest = records[len(expected) :]
    grants: list[str] = []
    batches = 0
    while rest:
        head = rest.pop(0)[9:-1].decode()
        if head.startswith("K "):
            _, crc, length = head.split(" ")
            covered = b""
            while len(covered) < int(length):
                covered += rest.pop(0)
            assert len(covered) == int(length) and f"{zlib.crc32(covered):08x}" == crc, head
            batches += 1
            assert len(covered.splitlines()) >= 16, head
            grants += [record[9:-1].decode() for record in covered.splitlines(keepends=True)]
        else:
            grants.append(head)
    assert batches >= 1, "no write of the burst was a batch"
    assert len(grants) == burst
    for n, (payload, token) in enumerate(zip(grants, burst_tokens, strict=True)):
        assert re.fullmatch(rf"G {token} b{n} 1 0 {lease} {until} c -", payload), payload
    copy = tmp_path / "copy"  # the journal as it was then (the stop released the rest since)
    copy.write_bytes(raw)
    read = read_journal(str(copy))
    assert not read.damage and read.records == len(records)
    assert len(read.leases.values()) == 3 + burst  # the slot, the hold, the bound one, the burst


def test_a_restored_grant_belongs_to_the_connection_that_renews_it(tmp_path: Path) -> None:
    server = ServerThread(config(tmp_path)).start()
    port = server.port
    (token,) = stopped_while_held(server, ("l", "k", f"0 {LEASE}"))
    with ServerThread(config(tmp_path, port=port)) as again:
        with Wire(again.address) as b:
            assert b.req("n", "k", f"{token} {LEASE}") == f"ok {LEASE}"
            (entry,) = again.stats()["locks"]
            assert entry["restored"] is False and entry["detached"] is False
        # b closed: auto-release on disconnect applies to the reattached grant again.
        with Wire(again.address) as c:
            wait_until(lambda: not again.stats()["locks"], what="the close released it")
            assert fence(c.lock("k")) > fence(token)
            assert c.req("r", "k", token) == "error"


def test_a_graceful_stop_keeps_the_leases_for_the_next_start(tmp_path: Path) -> None:
    server = ServerThread(config(tmp_path)).start()
    with Wire(server.address) as a:
        token = a.lock("k", lease=LEASE)
        port = server.port
        server.stop(drain=True)  # SIGTERM's path: the connections close after the journal
    with ServerThread(config(tmp_path, port=port)) as again, Wire(again.address) as b:
        assert b.req("r", "k", token) == "ok"


def test_no_state_dir_means_nothing_is_restored_and_a_fixed_port_waits(tmp_path: Path) -> None:
    with ServerThread(config(tmp_path)) as server, Wire(server.address) as a:
        a.lock("k", lease=LEASE)
        port = server.port
    off = Config(host="127.0.0.1", port=port, state_dir="none", max_lease_ttl_s=120)
    with ServerThread(off) as again:
        stats = again.stats()
        assert stats["journal"] is None and stats["locks"] == []
        assert 0 < stats["grace_remaining_s"] <= 120


def test_a_state_dir_with_a_fence_but_no_journal_waits_for_the_longest_lease(
    tmp_path: Path,
) -> None:
    with ServerThread(config(tmp_path)) as server, Wire(server.address) as a:
        a.lock("k", lease=45)
    (tmp_path / "journal").unlink()
    with ServerThread(config(tmp_path)) as again:
        stats = again.stats()
        assert 40 < stats["grace_remaining_s"] <= 45
        assert "holds no journal" in stats["grace_reason"]
        with Wire(again.address) as b:
            assert b.req("l", "free", "0") == "timeout"


def test_an_unreadable_longest_lease_record_is_named_as_the_reason_to_wait_the_maximum(
    tmp_path: Path,
) -> None:
    """No journal and a damaged grace record: the start waits max_lease_ttl_s and says the
    record could not be read (not that none was recorded)."""
    with ServerThread(config(tmp_path)) as server, Wire(server.address) as a:
        a.lock("k", lease=45)
    (tmp_path / "journal").unlink()
    (tmp_path / "grace").write_text("{not json\n")
    with ServerThread(config(tmp_path, max_lease_ttl_s=90)) as again:
        stats = again.stats()
        assert 80 < stats["grace_remaining_s"] <= 90
        reason = stats["grace_reason"]
        assert "holds no journal" in reason and "max_lease_ttl_s" in reason
        assert "does not hold a longest_lease_s" in reason, reason
        assert "no longest lease recorded" not in reason


@pytest.mark.parametrize("left", [b"", b"H 3 b0"], ids=["emptied", "cut-in-its-header"])
def test_a_journal_emptied_by_damage_waits_for_the_longest_lease(
    tmp_path: Path, left: bytes
) -> None:
    """A journal without a whole header never comes from a run (each file is written whole,
    fsynced, then renamed in place): a disk error and a repair left it so, and what the previous
    run granted is unknown, as with no journal at all (it restored nothing, with no grace)."""
    with ServerThread(config(tmp_path)) as server, Wire(server.address) as a:
        a.lock("k", lease=45)
    (tmp_path / "journal").write_bytes(left)
    with ServerThread(config(tmp_path)) as again:
        stats = again.stats()
        assert 40 < stats["grace_remaining_s"] <= 45, stats
        assert "holds no header" in stats["grace_reason"]
        with Wire(again.address) as b:
            assert b.req("l", "free", "0") == "timeout"


def test_every_renewal_writes_one_record_before_its_reply(tmp_path: Path) -> None:
    """Issue 47: renewals are recorded (group-committed with the grants), so a restore ends a
    lease where its holder was last told, not up to one lease later. On asyncio's loop, whose
    clock moves between two requests: uvloop's, read once per turn to the millisecond, can give
    two renewals the same end, which one record covers."""
    with (
        ServerThread(config(tmp_path), loop_factory=asyncio.new_event_loop) as server,
        Wire(server.address) as a,
    ):
        token = a.lock("k", lease=LEASE)
        before = read_journal(str(tmp_path / "journal")).records
        for _ in range(5):
            assert a.req("n", "k", f"{token} {LEASE}") == f"ok {LEASE}"
        assert read_journal(str(tmp_path / "journal")).records == before + 5


def test_a_write_bigger_than_a_batch_is_cut_into_batches_and_a_rewrite_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group write of more than ``BATCH_BYTES`` is several batches, each a ``K`` line and at
    most ``BATCH_BYTES`` of whole records after it; a compaction's new file is batched the same
    way; both read back whole, by the batches' checksums, one of them across the end of the
    reader's first chunk (``READ_CHUNK``, made smaller here: a file of 4 MiB and more takes
    seconds to write in a test)."""
    grants = 20_000  # about 1.6 MB
    chunk = 1_500_000
    monkeypatch.setattr(replay, "READ_CHUNK", chunk)
    now = [100.0]
    path = tmp_path / "journal"
    journal = Journal(str(path), "everysec", lambda: now[0])
    journal.anchor()
    journal.open([])
    tokens = iter(f"{n:032x}" for n in range(1, 2 * grants))
    table = LockTable(
        clock=lambda: now[0], new_token=lambda: next(tokens), max_locks=grants, journal=journal
    )
    owner = table.open_client()
    for n in range(grants):
        assert isinstance(table.acquire(owner, f"key-{n}", LEASE, None, queue=False), Holder)
    journal.flush()  # one write of them all

    def batches() -> list[tuple[int, int]]:
        """Where each batch's records start and end in the file."""
        data = path.read_bytes()
        spans: list[tuple[int, int]] = []
        at = 0
        for record in data.split(b"\n")[:-1]:
            at += len(record) + 1
            if record[9:11] == b"K ":
                spans.append((at, at + int(record.split(b" ")[3])))
        return spans

    for _ in ("the write", "a compaction"):
        spans = batches()
        assert len(spans) >= 2 and max(end - start for start, end in spans) <= BATCH_BYTES
        assert any(start < chunk < end for start, end in spans), spans
        read = read_journal(str(path))
        assert not read.damage and len(read.leases.values()) == grants
        assert sorted(rec.key for rec in read.leases.values()) == sorted(
            f"key-{n}" for n in range(grants)
        )
        journal.compact(Server._live_records(journal, table))
    journal.close()


def test_the_journal_is_compacted_and_still_restores(tmp_path: Path) -> None:
    with (
        ServerThread(config(tmp_path, lease_sweep_interval_s=0.05)) as server,
        Wire(server.address) as a,
    ):
        kept = a.lock("kept", lease=LEASE)
        # A renewal with a longer lease than the last one is recorded: alternating 60 and 61,
        # every other renewal writes a record (61 bytes): past the compaction's 4 MiB in 150,000.
        batch = b"".join(f"n\nkept\n{kept} {LEASE + i % 2}\n".encode() for i in range(1000))
        for _ in range(150):
            a.send_raw(batch)
            for _ in range(1000):
                assert a.recv().startswith("ok ")
        wait_until(lambda: server.stats()["journal"]["compactions"] >= 1, what="a compaction")
        assert (tmp_path / "journal").stat().st_size < 1_000_000
        assert server.stats()["locks"][0]["key"] == "kept"
        port = server.port
        server.stop()
    with ServerThread(config(tmp_path, port=port)) as again, Wire(again.address) as b:
        assert [e["key"] for e in again.stats()["locks"]] == ["kept"]
        assert b.req("r", "kept", kept) == "ok"


# ---------------------------------------------------------------- damage (acceptance 3)
def recorded_journal(tmp_path: Path) -> bytes:
    """A journal a real server wrote: grants, releases, renewals past the record, holds, notes,
    semaphore slots, and pipelined bursts of grants and releases (written in batches); some
    still held at the stop."""
    state = tmp_path / "source"
    rng = random.Random(26)
    with (
        ServerThread(config(state, max_locks_per_connection=0)) as server,
        Wire(server.address) as a,
    ):
        held: dict[str, str] = {}
        for i in range(300):
            key = f"k{rng.randrange(40)}"
            if key in held and rng.random() < 0.6:
                assert a.req("r", key, held.pop(key)) == "ok"
            elif key not in held:
                reply = a.req("l", key, f"0 {rng.choice((20, 40, 60))}")
                if reply.startswith("ok "):
                    held[key] = reply.split()[1]
            if i % 25 == 0:
                slot = a.req("sl", f"s{i}", f"0 2 {LEASE}").split()[1]
                a.req("n", f"s{i}", f"{slot} {LEASE + 5}")
            if i % 40 == 0:
                token = a.req("hl", f"h{i}", f"0 {LEASE} d note-{i}").split()[1]
                a.req("note", f"h{i}", f"{token} renamed-{i}")
            if i % 100 == 50:  # a burst: one write of many grants, then one of releases
                a.send_raw(b"".join(b"l\nb%d-%d\n0 %d\n" % (i, n, LEASE) for n in range(40)))
                burst = [a.recv().split()[1] for _ in range(40)]
                a.send_raw(
                    b"".join(
                        b"r\nb%d-%d\n%s\n" % (i, n, t.encode())
                        for n, t in enumerate(burst)
                        if n % 3
                    )
                )
                for n in range(40):
                    if n % 3:
                        assert a.recv() == "ok"
        assert held
    data = (state / "journal").read_bytes()
    assert b" K " in data  # (a batch's head)
    return data


def expected_tokens(data: bytes) -> list[str]:
    """The test's own reading: the grants not released among the whole, checked lines before
    the first damaged one (a damaged header restores nothing)."""
    live: dict[str, None] = {}
    for raw in data.split(b"\n")[:-1]:  # the last piece has no end of line (or is empty)
        if len(raw) < 10 or zlib.crc32(raw[9:]) != int(raw[:8] or b"0", 16):
            break
        fields = raw[9:].decode().split(" ")
        if fields[0] == "G":
            live[fields[1]] = None
        elif fields[0] == "R":
            live.pop(fields[1], None)
    return list(live)


async def restored_by_a_real_start(state_dir: Path) -> tuple[list[str], float]:
    server = Server(config(state_dir))
    await server.start()
    try:
        table = server.table
        tokens = [h.token for h, _, _ in table.live_holders()]
        return tokens, table.grace_remaining()
    finally:
        await server.stop(timeout_s=0)


def damaged_starts(tmp_path: Path, variants: list[bytes]) -> list[tuple[list[str], float]]:
    async def run() -> list[tuple[list[str], float]]:
        out: list[tuple[list[str], float]] = []
        for n, data in enumerate(variants):
            state = tmp_path / f"case{n}"
            state.mkdir()
            (state / "journal").write_bytes(data)
            out.append(await restored_by_a_real_start(state))
        return out

    return asyncio.run(run())


def test_a_journal_cut_anywhere_still_starts_and_restores_what_came_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = recorded_journal(tmp_path)
    rng = random.Random(200)
    offsets = sorted(rng.randrange(len(data)) for _ in range(200))
    with caplog.at_level(logging.WARNING, logger="dflockd_server"):
        results = damaged_starts(tmp_path, [data[:off] for off in offsets])
    for off, (tokens, grace) in zip(offsets, results, strict=True):
        assert sorted(tokens) == sorted(expected_tokens(data[:off])), off
        assert grace == 0.0, off  # a cut is a torn tail: nothing after it was acknowledged
    mid_record = sum(1 for off in offsets if off and data[off - 1 : off] != b"\n")
    assert caplog.text.count("journal: dropped") == mid_record
    assert "a write cut short" in caplog.text


def test_a_journal_with_flipped_bytes_still_starts_restores_the_records_before_and_waits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = recorded_journal(tmp_path)
    rng = random.Random(201)
    variants: list[bytes] = []
    firsts: list[int] = []
    for _ in range(200):
        damaged = bytearray(data)
        at = rng.randrange(len(data))
        damaged[at] ^= rng.randrange(1, 256)
        variants.append(bytes(damaged))
        firsts.append(at)
    with caplog.at_level(logging.WARNING, logger="dflockd_server"):
        results = damaged_starts(tmp_path, variants)
    for at, damaged, (tokens, grace) in zip(firsts, variants, results, strict=True):
        start = data.rfind(b"\n", 0, at) + 1  # the damaged record's line
        assert sorted(tokens) == sorted(expected_tokens(data[:start])), at
        if damaged[-1:] == b"\n":
            assert grace > 0, at  # a whole line damaged: what came after is unknown
    assert caplog.text.count("journal: dropped") == 200


def test_a_grant_whose_token_has_no_fence_is_damage_not_a_crash_of_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record that checks but whose token has no fence (not starting with hex: no server's)
    stopped the start with a ValueError (raising the fence counter above the restored tokens
    read its fence). It is damage now: what came before it is restored, and the start waits."""
    wall, mono = time.time_ns() // 1_000_000, time.monotonic_ns() // 1_000_000
    first, last = f"{5:016x}{7:016x}", f"{6:016x}{7:016x}"
    data = journal_bytes(
        f"G {first} a 1 0 60 {wall + 60_000} d -",
        f"G not-hex b 1 0 60 {wall + 60_000} d -",
        f"G {last} c 1 0 60 {wall + 60_000} d -",
        boot=replay.boot_id(),
        wall_ms=wall,
        mono_ms=mono,
    )
    with caplog.at_level(logging.WARNING, logger="dflockd_server"):
        [(tokens, grace)] = damaged_starts(tmp_path, [data])
    assert tokens == [first]
    assert grace > 0
    assert "has no fence" in caplog.text


def test_a_pause_of_the_collector_that_made_many_objects_freezes_them_a_small_one_does_not() -> (
    None
):
    """``paused_gc`` (around a start's read and restore): the objects a big restore made are
    frozen at its end, so that no collection scans them again; a small one (a test's server)
    leaves the collector as it was."""
    before = gc.get_freeze_count()
    try:
        with paused_gc():
            few = [[n] for n in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() == before
        with paused_gc():
            many = [[n] for n in range(2 * FREEZE_AFTER)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + 2 * FREEZE_AFTER
        assert len(few) + len(many) == 1000 + 2 * FREEZE_AFTER
    finally:
        gc.unfreeze()


def test_an_unknown_fsync_mode_is_refused_where_it_enters() -> None:
    """``Config`` checks it (the flag and the variable too: tests/server/test_settings.py's
    ``BAD``); the journal takes it as checked."""
    with pytest.raises(ValueError, match="always, everysec, no"):
        Config(journal_fsync="sometimes")


def test_a_taken_over_grant_comes_back_with_its_onclose_lease(tmp_path: Path) -> None:
    """A grant taken over with ``ht`` and an ``<onclose>`` lease is bound to whichever
    connection renews it after a restart, and that connection's close detaches it again
    (for the onclose lease) instead of releasing it."""
    server = ServerThread(config(tmp_path)).start()
    port = server.port
    with Wire(server.address) as a:
        token = a.req("hl", "q", f"0 {LEASE} d published").split()[1]
    with Wire(server.address) as b:
        assert b.req("ht", "q", f"{token} {LEASE} 30 running") == f"ok {LEASE}"
        server.stop()
    with ServerThread(config(tmp_path, port=port)) as again:
        (entry,) = again.stats()["locks"]
        assert entry["restored"] is True and entry["owner"] == "running"
        with Wire(again.address) as c:
            assert c.req("n", "q", f"{token} {LEASE}") == f"ok {LEASE}"
            (entry,) = again.stats()["locks"]
            assert entry["restored"] is False and entry["detached"] is False
        wait_until(lambda: again.stats()["locks"][0]["detached"], what="detached at the close")
        (entry,) = again.stats()["locks"]
        assert 0 < entry["lease_expires_in_s"] <= 30


@pytest.mark.parametrize("clients", [1, 4])
@pytest.mark.parametrize("fsync", ["everysec", "always", "no"])
def test_every_reply_leaves_after_its_record_is_in_the_file(
    tmp_path: Path, fsync: str, clients: int
) -> None:
    """Records before replies, for every fsync mode, one connection alone and several sharing
    the loop's group writes: the file is read the moment each reply arrives."""
    journal = tmp_path / "journal"
    server = ServerThread(config(tmp_path, journal_fsync=fsync)).start()
    failures: list[str] = []

    def client(n: int) -> None:
        with Wire(server.address) as w:
            for i in range(100):
                token = w.lock(f"k{n}-{i % 3}", lease=LEASE)
                if f" {token} ".encode() not in journal.read_bytes():
                    failures.append(f"grant {token} answered before its record")
                assert w.req("r", f"k{n}-{i % 3}", token) == "ok"
                if f" R {token}\n".encode() not in journal.read_bytes():
                    failures.append(f"release of {token} answered before its record")

    try:
        threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    assert failures == []


# ---------------------------------------------------------------- a journal that cannot be written
@pytest.mark.parametrize("fsync", ["default", "always"])
def test_a_grant_the_journal_cannot_hold_is_refused_and_nothing_else_is(
    tmp_path: Path, fsync: str
) -> None:
    """A write that fails, here at the server's file size limit (``RLIMIT_FSIZE``: the
    journal's write fails with EFBIG; CPython ignores SIGXFSZ): no client is told of a grant
    the journal does not hold (it is answered ``error_read_only``, and undone), no
    connection is dropped, no held lock freed, and the server grants again by itself once a
    new journal file can be written (the next sweep's, small: every lease held now). A real
    ``dflockd``, started as a user starts it: at the default fsync (the connection writes the
    journal) and with ``always`` (the group write). Before issue 47 the connection was closed
    unanswered, and every lock it held freed."""
    limit = 16 * 1024
    state = tmp_path / "state"
    log_path = tmp_path / "dflockd.log"
    flags = ["--state-dir", str(state)]
    if fsync != "default":
        flags += ["--journal-fsync", fsync]
    with dflockd_subprocess(log_path, *flags) as (proc, address), Wire(address) as wire:
        held = wire.lock("held-before", lease=LEASE)
        refused = ""
        for i in range(limit):  # a pair writes far more than a byte: the limit comes first
            if i == 5:
                resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
            reply = wire.req("l", f"journal-full:{i}", f"0 {LEASE}").split()
            if reply[0] != "ok":
                refused = f"journal-full:{i}"
                assert reply == ["error_read_only"], reply
                break
            assert wire.req("r", f"journal-full:{i}", reply[1]) == "ok"
        assert refused, "the file size limit was never reached"
        assert wire.req("ping", "_", "_") == "ok"  # the same connection, still open
        assert wire.req("n", "held-before", f"{held} {LEASE}") == f"ok {LEASE}"
        assert proc.poll() is None, "the server died with its journal"
        wait_until(
            lambda: "journal: cannot write" in log_path.read_text(),
            timeout=10.0,
            what="the journal's write failure logged",
        )
        with Wire(address) as rival:
            assert rival.req("l", "held-before", "0") in ("timeout", "error_read_only")

        def granted_again() -> bool:
            return wire.req("l", refused, f"0 {LEASE}").startswith("ok ")

        wait_until(granted_again, timeout=30.0, what="the server granting again by itself")
        assert wire.req("n", "held-before", f"{held} {LEASE}") == f"ok {LEASE}"
        read = read_journal(str(state / "journal"))
        assert read.damage == "", read.damage
        assert read.leases.get(held) is not None


def test_a_force_release_is_recorded_so_a_restart_does_not_bring_the_grant_back(
    tmp_path: Path,
) -> None:
    server = ServerThread(config(tmp_path)).start()
    keep_port = server.port
    with Wire(server.address) as a, Wire(server.address) as operator:
        a.req("hl", "q", f"0 {LEASE} d task-1")
        a.req("l", "k", f"0 {LEASE}")
        a.req("sl", "s", f"0 3 {LEASE}")
        assert operator.req("fr", "q", "ops") == "ok 1"
        assert operator.req("fr", "s", "_") == "ok 1"
        server.stop()  # as a crash would: "k" is still held
    with ServerThread(config(tmp_path, port=keep_port)) as again:
        stats = again.stats()
        assert stats["journal"]["restored"] == 1
        assert [e["key"] for e in stats["locks"]] == ["k"] and stats["semaphores"] == []


# ---------------------------------------------------------------- issue 52: restarts that append
def test_a_later_header_of_the_same_boot_puts_the_times_after_it_on_the_first_clock(
    tmp_path: Path,
) -> None:
    """A restart on the same boot appends its own anchor (the wall clock stepped 980 s ahead
    meanwhile, here): the times after it are read back on the first anchor's clock."""
    data = journal_bytes("G aaaa k1 1 0 20 1040000 c -")
    data += line("H 2 b00t 2000000 20500 always")
    data += line("G bbbb k2 1 0 20 2010000 c -") + line("X aaaa 20 2015000")
    read = read_journal(write(tmp_path, data))
    assert not read.damage and read.records == 5 and read.fsync == "always"
    assert by_token(read.leases)["bbbb"].until_ms == 1_030_000
    assert by_token(read.leases)["aaaa"].until_ms == 1_035_000
    got = restored_leases(read, monotonic_ms=20_500, this_boot="b00t")
    assert got.exact and sorted((r.key, r.left) for r in got.leases) == [
        ("k1", 15.0),
        ("k2", 10.0),
    ]


def test_a_later_header_of_another_boot_makes_the_file_read_as_of_another_boot(
    tmp_path: Path,
) -> None:
    data = journal_bytes("G aaaa k1 1 0 20 1040000 c -", fsync="always")
    data += line("H 2 other 5000 100 always") + line("G bbbb k2 1 0 20 9000 c -")
    read = read_journal(write(tmp_path, data))
    assert read.anchor is not None and read.anchor[0] == "-"
    got = restored_leases(read, run_longest=30, monotonic_ms=20_500, this_boot="b00t")
    assert not got.exact and [r.left for r in got.leases] == [30.0, 30.0]


@pytest.mark.parametrize("cut", [0, 5, 60])
def test_a_journal_read_in_small_chunks_reads_as_one_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: int
) -> None:
    """The file is read a chunk at a time: records across chunk ends, damage and a torn tail
    read the same whatever the chunk size."""
    import dflockd_server.replay as replay

    grants = [f"G a{n} k{n} 1 0 20 1040000 c - note {n}" for n in range(30)]
    whole = journal_bytes(*grants, "R a3", "X a4 25 1050000")
    data = bytearray(whole[: len(whole) - cut])
    if cut == 60:
        data[len(data) // 2] ^= 0x01  # damage in the middle too
    path = write(tmp_path, bytes(data))
    expected = read_journal(path)
    for chunk in (1, 7, 64, 1000):
        monkeypatch.setattr(replay, "READ_CHUNK", chunk)
        got = read_journal(path)
        assert (recorded(got.leases), got.records, got.damage) == (
            recorded(expected.leases),
            expected.records,
            expected.damage,
        )
        assert (got.dropped_bytes, got.dropped_lines, got.torn_tail) == (
            expected.dropped_bytes,
            expected.dropped_lines,
            expected.torn_tail,
        )
    assert bool(expected.damage) == (cut > 0)


def test_a_restart_on_the_same_boot_appends_to_the_journal_and_the_next_one_reads_it(
    tmp_path: Path,
) -> None:
    """Issue 52: the restart does not rewrite every lease; it appends its header (and the end
    of the leases that ended meanwhile), and each later restart restores from the file."""
    server = ServerThread(config(tmp_path)).start()
    keep_port = server.port
    (lock, short) = stopped_while_held(server, ("l", "k", f"0 {LEASE}"), ("l", "brief", "0 1"))
    path = str(tmp_path / "journal")
    size = Path(path).stat().st_size
    time.sleep(1.2)  # the lease of "brief" ends before the restart
    for starts in (2, 3):
        with ServerThread(config(tmp_path, port=keep_port)) as again, Wire(again.address) as b:
            assert again.stats()["journal"]["restored"] == 1
            assert b.req("l", "k", "0") == "timeout"
        read = read_journal(path)
        assert Path(path).read_bytes().count(b" H 3 ") == starts and not read.damage
        assert tokens_of(read.leases) == [lock]
        assert Path(path).stat().st_size > size
    assert read_journal(path).leases.get(short) is None
