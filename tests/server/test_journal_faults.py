"""The lease journal under disk and clock faults (issue 47), against a real ``dflockd`` started
as a user starts it: a reboot with the wall clock stepped either way, a state directory on a
full file system (a small tmpfs this test mounts: root only, skipped otherwise), and, through
the journal's own seams, a failed fsync and a directory fsync that fails after a compaction's
rename (no real way makes the kernel fail an fsync on demand: a full disk fails writes, not
fsyncs; a device-mapper error target would, but needs a block device this test cannot count
on)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dflock.client import Client, DistributedLock
from celery_dflock.client.errors import ServerReadOnly
from celery_dflock.client.wire import DEFAULT_MAX_LEASE_TTL_S
from dflockd_server import journal as journal_module
from dflockd_server.config import Config
from dflockd_server.fence import fsync_dir as real_fsync_dir
from dflockd_server.journal import Journal
from dflockd_server.keys import Holder
from dflockd_server.pagecache import mount_id, tail_resident
from dflockd_server.replay import COMPLETE_SUFFIX, boot_id, read_journal, restored_leases
from dflockd_server.table import LockTable
from dflockd_server.testing import ServerThread
from tests.support.disks import bound, fill, own_ext4, remounted, small_tmpfs
from tests.support.pids import no_more_threads
from tests.support.servers import clean_env, dflockd_executable, dflockd_subprocess
from tests.support.tables import tokens_of
from tests.support.waiting import wait_until
from tests.support.wire import Wire

LEASE = 60
TOKEN = "7" * 16 + "0123456789abcdef"
"""A token the previous boot's server issued (its fence: far above the wall clock's)."""


def _line(payload: str) -> bytes:
    return b"%08x %s\n" % (zlib.crc32(payload.encode()), payload.encode())


def previous_boot_journal(state: Path, *, clock_step_s: int, fsync: str) -> None:
    """What a server of the previous boot left: its journal with one lock granted 1 s before
    the machine went down, with ``LEASE`` s left then, and the grace record of its run. The
    wall clock of that boot differs from this one's by ``clock_step_s`` (positive: the clock is
    now ahead of the one the journal was written with)."""
    state.mkdir(mode=0o700, parents=True)
    other_boot = uuid.uuid4().hex
    assert other_boot != boot_id()
    wall_then = time.time_ns() // 1_000_000 - clock_step_s * 1000 - 1000
    until = wall_then + LEASE * 1000
    header = f"H 2 {other_boot} {wall_then - 5000} 123456 {fsync}"
    if fsync == "v1":  # written by the release before issue 47 (no fsync field)
        header = f"H 1 {other_boot} {wall_then - 5000} 123456"
    (state / "journal").write_bytes(
        _line(header) + _line(f"G {TOKEN} held 1 0 {LEASE} {until} c -")
    )
    (state / "journal.complete").touch()
    (state / "grace").write_text(f'{{"longest_lease_s": {LEASE}}}\n')


@pytest.mark.parametrize("clock_step_s", [600, -600])
@pytest.mark.parametrize("fsync", ["always", "everysec", "v1"])
def test_a_reboot_with_the_wall_clock_stepped_restores_every_live_lease(
    tmp_path: Path, clock_step_s: int, fsync: str
) -> None:
    """Acceptance 1. The review's case: a reboot with the wall clock 600 s ahead restored 0
    leases and granted a rival a key whose lease had 59 s left. Now the lease comes back for
    its full lease from the start, never a rival at once; and when the journal was not fsynced
    at each reply (``everysec``, or a version-1 file that does not say: its last records may be
    lost with the machine), nothing at all is granted until the longest lease recorded could
    have ended."""
    state = tmp_path / "state"
    previous_boot_journal(state, clock_step_s=clock_step_s, fsync=fsync)
    log_path = tmp_path / "dflockd.log"
    with (
        dflockd_subprocess(log_path, "--state-dir", str(state)) as (_, address),
        Wire(address) as rival,
        Wire(address) as holder,
    ):
        assert rival.req("l", "held", "0") == "timeout"  # before issue 47: "ok" at +600 s
        free = rival.req("l", "free", "0")
        if fsync == "always":
            assert free.startswith("ok "), free
        else:
            assert free == "timeout"  # the grace: a grant of the last second may be lost
        assert holder.req("n", "held", f"{TOKEN} {LEASE}") == f"ok {LEASE}"  # reattached
        assert rival.req("l", "held", "0") == "timeout"
        text = log_path.read_text()
        assert "another boot (the wall clock is not trusted across a boot)" in text, text


@contextlib.contextmanager
def dflockd_after_a_reboot(tmp_path: Path, port: int, state: Path) -> Iterator[tuple[str, int]]:
    """The real ``dflockd`` on ``port`` with ``state``, on what looks like another boot of the
    machine: in a mount namespace of its own, a file with another boot id is bound over
    ``/proc/sys/kernel/random/boot_id`` (root only; skipped otherwise). The server itself is
    started as a user starts it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("faking a reboot (a boot id in a mount namespace) needs root and unshare")
    fake = tmp_path / "boot_id"
    fake.write_text(str(uuid.uuid4()) + "\n")
    script = 'mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@"'
    log_path = tmp_path / "rebooted.log"
    address = ("127.0.0.1", port)
    command = ["unshare", "-m", "sh", "-c", script, str(fake), dflockd_executable()]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state)],
            env=clean_env({}),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(log_path.read_text())
            with contextlib.suppress(OSError):
                socket.create_connection(address, timeout=0.5).close()
                return True
            return False

        wait_until(listening, timeout=15.0, what="dflockd listening after the reboot")
        yield address
    finally:
        proc.kill()
        proc.wait(10)
    text = log_path.read_text()
    assert "another boot" in text, text


@pytest.mark.parametrize("fsync", ["always", "everysec"])
def test_a_lease_outlives_a_reboot_of_the_machine(tmp_path: Path, fsync: str) -> None:
    """Acceptance 1, with a journal the real server wrote: a lease granted, the server killed,
    and the next start on another boot (its boot id differs, as the kernel reports it). Every
    live lease is restored for a full lease from the start, never a rival at once; with
    ``everysec`` nothing at all is granted for the longest lease."""
    state = tmp_path / "state"
    log_path = tmp_path / "dflockd.log"
    args = ("--state-dir", str(state), "--journal-fsync", fsync)
    with dflockd_subprocess(log_path, *args) as (proc, address):
        port = address[1]
        with Wire(address) as holder:
            token = holder.lock("held", lease=LEASE)
        proc.kill()
        proc.wait(10)
    with dflockd_after_a_reboot(tmp_path, port, state) as address, Wire(address) as rival:
        assert rival.req("l", "held", "0") == "timeout"
        free = rival.req("l", "free", "0")
        assert free.startswith("ok ") if fsync == "always" else free == "timeout", free
        assert rival.req("n", "held", f"{token} {LEASE}") == f"ok {LEASE}"


def test_a_start_killed_during_its_restart_grace_leaves_the_rest_of_it_to_the_next(
    tmp_path: Path,
) -> None:
    """A start that waits out a restart grace (here after a reboot, the journal ``everysec``:
    the previous boot's last second of grants may be lost) is killed during it: the next start
    on this boot waits out the rest of it. Before, the first start's new journal, written on
    this boot and complete, was read as whole and the next start granted at once: a key the
    lost last second had granted could go to a rival while its holder still held it."""
    state = tmp_path / "state"
    previous_boot_journal(state, clock_step_s=0, fsync="everysec")
    log_path = tmp_path / "dflockd.log"
    before = time.monotonic()
    with dflockd_subprocess(log_path, "--state-dir", str(state)) as (proc, address):
        started = time.monotonic()  # its grace began between ``before`` and now
        port = address[1]
        with Wire(address) as probe:
            assert probe.req("l", "free", "0") == "timeout"  # in the grace
        proc.kill()
        proc.wait(10)
    with (
        dflockd_subprocess(log_path, "--state-dir", str(state), port=port) as (_, address),
        Wire(address) as probe,
    ):
        assert probe.req("l", "free", "0") == "timeout"
        asked = time.monotonic()
        stats = json.loads(probe.req("stats", "_", "_").removeprefix("ok "))
        answered = time.monotonic()
    left = float(stats["grace_remaining_s"])
    # Never before the first start's grace would have ended (the rest is counted from the
    # second start's plan: the time to its table, a record's fsync among it, comes on top).
    assert before + LEASE - answered - 0.01 <= left <= started + LEASE - asked + 2.0, left
    assert "stopped during its restart grace" in stats["grace_reason"], stats["grace_reason"]


def test_the_mount_a_path_is_on_and_whether_a_files_last_page_is_cached(tmp_path: Path) -> None:
    """``pagecache`` on a real file system: a new mount of it (a new mount id) starts with a
    cold page cache, a bind mount of it (a new mount id too) shares the page cache of the mount
    it binds."""
    image = tmp_path / "disk.img"
    with own_ext4(tmp_path / "disk", image, "16M") as disk:
        journal = disk / "journal"
        journal.write_bytes(b"x" * 10_000)
        first = mount_id(str(disk))
        if first is None:
            pytest.skip("this kernel gives no unique mount id (statx, Linux 6.8)")
        assert mount_id(str(journal)) == first
        assert tail_resident(str(journal)) is True
        with bound(disk, tmp_path / "bind") as bind:
            assert mount_id(str(bind)) not in (None, first)
            assert tail_resident(str(bind / "journal")) is True
        remounted(disk, image)
        assert mount_id(str(disk)) not in (None, first)
        assert tail_resident(str(journal)) is False
        # Asking reads nothing in (cachestat: a kernel with mount ids has it): asked again once
        # a read-in it had started would be done, the page is still out. (A read with
        # RWF_NOWAIT started one, at times done before that read looked again: a file system
        # mounted anew was taken for the old mount, test_journal_nemeses' read-only failure.)
        time.sleep(0.2)
        assert tail_resident(str(journal)) is False
        journal.read_bytes()  # as the start reads it next: then it is cached
        assert tail_resident(str(journal)) is True
        assert tail_resident(str(tmp_path / "missing")) is None


def test_a_restart_through_a_new_bind_mount_of_the_state_dir_restores_exactly(
    tmp_path: Path,
) -> None:
    """A container restarted in place gets its volume bind-mounted anew (another mount id) on a
    file system that stayed mounted: the page cache is the one the journal was written
    through, so the start restores each lease to its recorded end and grants free keys at
    once, as a restart of the process alone does. Unmounted and mounted again, the same start
    waits out the longest lease (what the kernel had not put on the disk may be gone)."""
    image = tmp_path / "disk.img"
    log_path = tmp_path / "dflockd.log"
    with own_ext4(tmp_path / "disk", image, "16M") as disk:
        (disk / "volume").mkdir()
        where = tmp_path / "state"
        if mount_id(str(disk)) is None:
            pytest.skip("this kernel gives no unique mount id (statx, Linux 6.8)")
        args = ("--state-dir", str(where))
        with (
            bound(disk / "volume", where),
            dflockd_subprocess(log_path, *args) as (proc, address),
        ):
            port = address[1]
            with Wire(address) as holder:
                holder.lock("held", lease=LEASE)
            proc.kill()
            proc.wait(10)
        with (
            bound(disk / "volume", where),
            dflockd_subprocess(log_path, *args, port=port) as (proc, address),
            Wire(address) as probe,
        ):
            assert probe.req("l", "held", "0") == "timeout"
            assert probe.req("l", "free", "0").startswith("ok ")
            proc.kill()
            proc.wait(10)
        assert "mounted anew" not in log_path.read_text()
        remounted(disk, image)
        with (
            bound(disk / "volume", where),
            dflockd_subprocess(log_path, *args, port=port) as (_, address),
            Wire(address) as probe,
        ):
            assert probe.req("l", "held", "0") == "timeout"
            assert probe.req("l", "other", "0") == "timeout"  # the grace: nothing granted
        assert "mounted anew" in log_path.read_text()


def grant_until_a_write_fails(wire: Wire) -> None:
    """Acquire and release keys on a full state dir until the journal's write fails (its last
    page fills): the acquire that meets it is answered ``error_read_only``."""
    for i in range(10_000):
        reply = wire.req("l", f"k{i}", "0")
        if reply == "error_read_only":
            return
        assert reply.startswith("ok "), (i, reply)
        assert wire.req("r", f"k{i}", reply.split()[1]) == "ok"
    raise AssertionError("10,000 grants on a full state dir and no write failed")


def evict(path: Path) -> None:
    """Put ``path`` on the disk and drop its pages from the page cache (as memory pressure
    does to clean pages; after an fsync that failed, its unwritten pages are clean too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("evicted", [False, True])
def test_a_restart_after_a_failed_write_waits_once_the_journals_last_page_left_the_cache(
    tmp_path: Path, evicted: bool
) -> None:
    """A server killed while its journal could not be written (no ``complete`` mark) restarts
    on the same boot. Its file holds what the kernel has of it, unless an fsync failed and the
    pages it could not write have left the page cache since (they are gone then): the start
    cannot tell a failed fsync from a full disk, so with the journal's last page out of the
    cache it waits out the longest lease before granting (before, it granted at once); with
    the page still there it grants at once, as it always did."""
    image = tmp_path / "disk.img"
    log_path = tmp_path / "dflockd.log"
    with own_ext4(tmp_path / "disk", image, "16M") as disk:
        state = disk / "state"
        args = ("--state-dir", str(state))
        with dflockd_subprocess(log_path, *args) as (proc, address):
            port = address[1]
            with Wire(address) as wire:
                wire.lock("held", lease=LEASE)
                filler = fill(disk)
                grant_until_a_write_fails(wire)
                assert not (state / ("journal" + COMPLETE_SUFFIX)).exists()
            proc.kill()
            proc.wait(10)
        filler.unlink()
        if evicted:
            evict(state / "journal")  # (not asked here: an uncached read may read it back in)
        with (
            dflockd_subprocess(log_path, *args, port=port) as (_, address),
            Wire(address) as probe,
        ):
            assert probe.req("l", "held", "0") == "timeout"
            free = probe.req("l", "free", "0")
        assert free == "timeout" if evicted else free.startswith("ok "), free
        assert ("no longer in the page cache" in log_path.read_text()) == evicted


def test_a_full_state_dir_refuses_grants_and_keeps_every_holder(tmp_path: Path) -> None:
    """Acceptance 2. The review's case: with the state dir full (ENOSPC), every connection that
    sent anything was dropped unanswered, auto-release freed every held lock, the holder's
    reattach was refused after space returned. Now nothing is dropped or freed: ``ping``,
    renewals and releases are answered, new grants are refused (``error_read_only``), and the
    server grants again by itself once space is back."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        state = disk / "state"
        log_path = tmp_path / "dflockd.log"
        with (
            dflockd_subprocess(log_path, "--state-dir", str(state)) as (proc, address),
            Wire(address) as holder,
            Wire(address) as other,
        ):
            token = holder.lock("held", lease=LEASE)
            hold = holder.req("hl", "held-detached", f"0 {LEASE} d run-1")
            assert hold.startswith("ok "), hold
            hold_token = hold.split()[1]
            filler = fill(disk)
            # Writes go on into the journal's last page, then fail: that grant is refused
            # (not sent, and undone), and so is every grant after it.
            for i in range(10_000):
                reply = other.req("l", f"k{i}", "0")
                if reply == "error_read_only":
                    break
                assert reply.startswith("ok "), reply
                assert other.req("r", f"k{i}", reply.split()[1]) == "ok"
            assert other.req("l", "new", "0") == "error_read_only"
            assert other.req("ping", "_", "_") == "ok"
            assert holder.req("n", "held", f"{token} {LEASE}") == f"ok {LEASE}"
            assert other.req("l", "held", "0") == "error_read_only"
            assert other.req("hl", "another", f"0 {LEASE} c x") == "error_read_only"
            assert holder.req("stats", "_", "_").startswith("ok ")
            wait_until(
                lambda: "journal: cannot write" in log_path.read_text(),
                timeout=10.0,
                what="the write failure logged",
            )
            assert not (state / ("journal" + COMPLETE_SUFFIX)).exists()
            # The holder of the detached hold comes back while the disk is full: not yet.
            assert holder.req("ht", "held-detached", f"{hold_token} {LEASE} r run-1") == (
                "error_read_only"
            )
            assert proc.poll() is None
            filler.unlink()
            wait_until(
                lambda: other.req("l", "new", "0").startswith("ok "),
                timeout=30.0,
                what="granting again once space is back",
            )
            assert holder.req("n", "held", f"{token} {LEASE}") == f"ok {LEASE}"
            taken = holder.req("ht", "held-detached", f"{hold_token} {LEASE} r run-1")
            assert taken == f"ok {LEASE}", taken
            assert (state / ("journal" + COMPLETE_SUFFIX)).exists()
            assert read_journal(str(state / "journal")).leases.get(token) is not None
            assert "can be written again" in log_path.read_text()


def test_a_start_on_a_full_disk_restores_and_serves_read_only(tmp_path: Path) -> None:
    """The review's case: a restart on the full disk exited 1. Now it restores what the journal
    holds, answers its holders, refuses new grants once the disk refuses their records, and
    grants once space is back."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        state = disk / "state"
        log_path = tmp_path / "dflockd.log"
        with dflockd_subprocess(log_path, "--state-dir", str(state)) as (proc, address):
            port = address[1]
            with Wire(address) as holder:
                token = holder.lock("held", lease=LEASE)
            proc.kill()
            proc.wait(10)
        filler = fill(disk)
        with (
            dflockd_subprocess(log_path, "--state-dir", str(state), port=port) as (_, address),
            Wire(address) as holder,
        ):
            # The start appends its header to the journal (issue 52): it may fit in the slack
            # of the file's last page, and the grants after it too, until the disk refuses one.
            refused = ""
            for n in range(200):
                refused = holder.req("l", f"fresh-{n}", "0")
                if refused == "error_read_only":
                    break
            assert refused == "error_read_only"
            assert holder.req("l", "held", "0") in ("timeout", "error_read_only")
            assert holder.req("n", "held", f"{token} {LEASE}") == f"ok {LEASE}"
            # The refusal may come from the journal's write or from the fence ceiling's store
            # ahead (its own file on the same disk, written off the loop): the disk's error is
            # logged either way, the store's once its write fails (a CPython 3.12 CI run read
            # the log before that).
            wait_until(
                lambda: "No space left on device" in log_path.read_text(),
                what="the full disk's error in the log",
                timeout=20,
            )
            filler.unlink()
            wait_until(
                lambda: holder.req("l", "free", "0").startswith("ok "),
                timeout=30.0,
                what="granting again once space is back",
            )
            assert holder.req("l", "held", "0") == "timeout"


# ---------------------------------------------------------------- the journal's own seams
def table_on(journal: Journal, now: list[float]) -> LockTable:
    tokens = iter(f"{n:032x}" for n in range(1, 1000))
    return LockTable(
        clock=lambda: now[0], new_token=lambda: next(tokens), max_locks=100, journal=journal
    )


def test_a_grant_after_a_failed_compaction_is_in_the_journal_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acceptance 3. The review's case: EIO on the directory fsync after the rename left the
    writer on the old, unlinked file; a grant acknowledged then was gone after kill -9. Now the
    writer is on the file that is the journal before the fsync can fail, the failure makes the
    journal not writable (that grant is refused), and once the sweep has written a new file the
    grant that follows is in the file a restart reads (a kill -9 loses nothing written)."""
    failing = [False]

    def fsync_dir(directory: str) -> None:
        if failing[0]:
            raise OSError(5, "Input/output error")
        real_fsync_dir(directory)

    monkeypatch.setattr(journal_module, "_fsync_dir", fsync_dir)
    now = [100.0]
    path = str(tmp_path / "journal")
    journal = Journal(path, "everysec", lambda: now[0])
    journal.anchor()
    journal.open([])
    table = table_on(journal, now)
    client = table.open_client()
    first = table.acquire(client, "before", 30, None, queue=False)
    assert isinstance(first, Holder)
    journal.flush()
    failing[0] = True
    with contextlib.suppress(OSError):  # (before issue 47 the failure was raised)
        journal.compact([journal.grant_record(first, None, False, None)])
    failing[0] = False
    recover = getattr(journal, "recover", None)  # the sweep's probe (none before issue 47)
    if recover is not None:
        assert recover([journal.grant_record(first, None, False, None)])
    after = table.acquire(client, "after", 30, None, queue=False)
    assert isinstance(after, Holder)
    journal.flush()  # acknowledged: the reply would leave now
    assert not getattr(journal, "refused", [])
    assert set(tokens_of(read_journal(path).leases)) == {first.token, after.token}


def _fsyncs(wire: Wire) -> int:
    stats = json.loads(wire.req("stats", "_", "_").removeprefix("ok "))
    return int(stats["journal"]["fsyncs"])


@pytest.mark.parametrize("limited", ["after-the-first-fsync", "from-the-start"])
def test_everysec_goes_on_fsyncing_on_a_host_that_can_start_no_more_threads(
    tmp_path: Path, limited: str
) -> None:
    """A nemesis: the server reaches its container's pid limit (threads count). The everysec
    fsync ran in a thread started per fsync: once one could not be started, the journal was
    never fsynced again, its stats and log saying nothing of it (stats' ``fsyncs`` stood
    still while grants went on). Now one thread, started at the first everysec fsync, does
    them all; where even that one cannot be started, the loop fsyncs, and says so."""
    log_path = tmp_path / "dflockd.log"
    with (
        dflockd_subprocess(log_path, "--state-dir", str(tmp_path / "state")) as (proc, address),
        Wire(address) as wire,
    ):
        if limited == "after-the-first-fsync":
            opened = _fsyncs(wire)
            wire.lock("before", lease=LEASE)
            wait_until(lambda: _fsyncs(wire) > opened, timeout=10.0, what="an everysec fsync")
        with no_more_threads(proc.pid):
            start = _fsyncs(wire)
            for i in range(3):
                wire.lock(f"limited-{i}", lease=LEASE)
                wait_until(
                    lambda: _fsyncs(wire) > start + i,  # noqa: B023 (called at once)
                    timeout=10.0,
                    what=f"an everysec fsync after grant {i} under the pid limit",
                )
            assert proc.poll() is None
        log = log_path.read_text()
        assert "Traceback" not in log
        on_the_loop = log.count("no thread for the everysec fsync")
        assert on_the_loop == (1 if limited == "from-the-start" else 0), log


def test_the_fence_ceiling_thread_is_started_with_the_server(tmp_path: Path) -> None:
    """The same nemesis for the fence counter: each next ceiling is stored on a thread of its
    own, which was started at the first store, half a block (524,288 grants) after the start.
    A server at its pid limit by then could store no ceiling, and granted nothing past the
    stored one. The thread is now started before the server serves. (Driving a real server
    through half a block of grants under a pid limit takes longer than a test may.)"""
    with ServerThread(Config(host="127.0.0.1", port=0, state_dir=str(tmp_path / "state"))):
        names = [thread.name for thread in threading.enumerate()]
        assert any(name.startswith("dflockd-fence-ceiling") for name in names), names


def test_a_failed_fsync_is_a_failed_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Acceptance 4. The review's case: the everysec thread cleared ``dirty`` before it called
    fsync, and a failure was only logged. Now what was written stays unsynced, the journal is
    not writable from the loop's next write on (the grants of that batch refused), and a new
    file (written and fsynced anew) ends the episode."""
    now = [100.0]
    failing = [False]
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if failing[0]:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    journal = Journal(str(tmp_path / "journal"), "everysec", lambda: now[0])
    journal.anchor()
    journal.open([])
    table = table_on(journal, now)
    held = table.acquire(table.open_client(), "held", 30, None, queue=False)
    assert isinstance(held, Holder)
    journal.flush()
    assert journal.dirty
    failing[0] = True
    with pytest.raises(OSError):
        journal.sync()
    assert journal.dirty  # not marked synced (before issue 47: cleared before the fsync)
    refused = table.acquire(table.open_client(), "next", 30, None, queue=False)
    assert isinstance(refused, Holder)
    journal.flush()
    assert not journal.writable
    assert journal.take_refused() == [("next", refused.token)]
    failing[0] = False
    assert journal.recover([journal.grant_record(held, None, False, None)])
    assert not journal.dirty and journal.writable


def test_a_stop_whose_fsync_fails_leaves_no_mark_that_the_file_is_whole(tmp_path: Path) -> None:
    """A graceful stop writes ``C`` and fsyncs. When that fsync failed, ``C`` and the
    ``complete`` mark stayed: a start on this boot whose journal's last page had left the page
    cache (the records the fsync could not write gone with it) took the file as whole and
    granted at once. Now the stop leaves neither, and such a start waits (``_tail_lost``)."""
    now = [100.0]
    failing = [False]

    def fsync_file(fd: int) -> None:
        if failing[0]:
            raise OSError(5, "Input/output error")
        os.fsync(fd)

    path = str(tmp_path / "journal")
    journal = Journal(path, "everysec", lambda: now[0], fsync_file=fsync_file)
    journal.anchor()
    journal.open([])
    table = table_on(journal, now)
    assert isinstance(table.acquire(table.open_client(), "held", 30, None, queue=False), Holder)
    journal.flush()
    failing[0] = True
    with pytest.raises(OSError):
        journal.close()
    read = read_journal(path)
    assert not read.clean and not read.damage
    assert not os.path.exists(path + COMPLETE_SUFFIX)
    assert [rec.key for rec in read.leases.values()] == ["held"]
    restore = restored_leases(read, complete=False, run_longest=30, tail_lost="page gone")
    assert restore.grace_s == 30


def test_with_always_a_failed_fsync_refuses_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--journal-fsync always``: the grants of a batch whose fsync failed are refused (their
    replies must not leave), and the journal is not writable."""
    now = [100.0]
    failing = [False]
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if failing[0]:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    journal = Journal(str(tmp_path / "journal"), "always", lambda: now[0])
    journal.anchor()
    journal.open([])
    table = table_on(journal, now)
    held = table.acquire(table.open_client(), "k", 30, None, queue=False)
    assert isinstance(held, Holder)
    failing[0] = True
    journal.flush()
    assert not journal.writable
    assert journal.take_refused() == [("k", held.token)]


def test_a_restored_lease_ends_where_its_last_renewal_put_it(tmp_path: Path) -> None:
    """The review's case: holders' renewals were not recorded, so a restore ran a lease from
    its grant record, up to one lease past its real end (rivals waited ~10 s for keys nobody
    held). Now a lease restored after a kill -9 ends where its last renewal put it: never
    before (what a client was told), and within the stated margin after (a millisecond of
    rounding, plus the clock readings of the restart: 0.5 s here, far above both)."""
    state = tmp_path / "state"
    log_path = tmp_path / "dflockd.log"
    with dflockd_subprocess(log_path, "--state-dir", str(state)) as (proc, address):
        port = address[1]
        with Wire(address) as holder:
            token = holder.lock("held", lease=LEASE)
            renew_sent = time.monotonic()
            assert holder.req("n", "held", f"{token} {LEASE}") == f"ok {LEASE}"
            renew_replied = time.monotonic()
            time.sleep(2.0)  # the lease runs on; a restore from the grant would add this back
            proc.kill()
            proc.wait(10)
    with (
        dflockd_subprocess(log_path, "--state-dir", str(state), port=port) as (_, address),
        Wire(address) as probe,
    ):
        stats_sent = time.monotonic()
        reply = probe.req("stats", "_", "_")
        stats_replied = time.monotonic()
    (lock,) = [lock for lock in json.loads(reply[3:])["locks"] if lock["key"] == "held"]
    left = float(lock["lease_expires_in_s"])
    assert stats_replied + left >= renew_sent + LEASE  # never before the real end
    assert stats_sent + left <= renew_replied + LEASE + 0.5, left  # nor much after it


def test_our_client_keeps_its_lock_through_a_full_disk_and_is_told_why_it_gets_none(
    tmp_path: Path,
) -> None:
    """This project's client against a server whose state dir is full: a lock it holds keeps
    renewing past its lease (never lost), a new acquire raises ``ServerReadOnly`` (a
    ``ServerUnavailable``, whose message says what is wrong), and once space is back it is
    granted again without anything else done."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        state = disk / "state"
        log_path = tmp_path / "dflockd.log"
        with (
            dflockd_subprocess(log_path, "--state-dir", str(state)) as (_, address),
            Wire(address) as wire,
        ):
            held = DistributedLock("held", servers=[address], lease_ttl_s=2)
            assert held.acquire()
            filler = fill(disk)
            grant_until_a_write_fails(wire)
            other = DistributedLock("other", servers=[address], acquire_timeout_s=0)
            with pytest.raises(ServerReadOnly, match="cannot write its lease journal"):
                other.acquire()
            # A renewal by token asking a longer lease than any recorded: the bound's record
            # cannot be written either. Refused as the acquire is, the grant left as it was.
            with Client([address]) as client, pytest.raises(ServerReadOnly):
                assert held.token is not None
                client.renew("held", held.token, lease_ttl=DEFAULT_MAX_LEASE_TTL_S)
            time.sleep(4.0)  # two leases: only renewals keep "held"
            assert held.owned() and not held.lost_event.is_set()
            filler.unlink()

            def granted() -> bool:
                try:
                    return other.acquire()
                except ServerReadOnly:
                    return False  # not yet: the next sweep writes a new journal

            wait_until(granted, timeout=30.0, what="a grant once space is back")
            assert other.release()
            assert held.release()


def test_a_renewal_answered_while_the_disk_is_full_is_kept_by_a_restart(tmp_path: Path) -> None:
    """The rule for renewals the journal could not record: the ``complete`` mark is removed
    before any is answered, and a start without it restores each lease for a full lease (at
    least the longest recorded) from the start, so a lease never ends before the end its last
    renewal gave, recorded or not. Here the journal's record of the lease ends 3 s before that
    renewal's end."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        state = disk / "state"
        log_path = tmp_path / "dflockd.log"
        with dflockd_subprocess(log_path, "--state-dir", str(state)) as (proc, address):
            port = address[1]
            with Wire(address) as wire:
                token = wire.lock("held", lease=LEASE)
                time.sleep(3.0)
                filler = fill(disk)
                grant_until_a_write_fails(wire)
                renew_sent = time.monotonic()
                assert wire.req("n", "held", f"{token} {LEASE}") == f"ok {LEASE}"  # unrecorded
                assert not (state / ("journal" + COMPLETE_SUFFIX)).exists()
            proc.kill()
            proc.wait(10)
        filler.unlink()
        with (
            dflockd_subprocess(log_path, "--state-dir", str(state), port=port) as (_, address),
            Wire(address) as probe,
        ):
            reply = probe.req("stats", "_", "_")
            stats_replied = time.monotonic()
            assert probe.req("l", "held", "0") == "timeout"
    (lock,) = [lock for lock in json.loads(reply[3:])["locks"] if lock["key"] == "held"]
    assert stats_replied + float(lock["lease_expires_in_s"]) >= renew_sent + LEASE
    assert "may lack renewals" in log_path.read_text()
