"""The lease journal's nemeses under the history checker (issue 47): the state directory fills
up under load, stalls (its file system frozen) under load, turns read-only under load (a disk
error) and is repaired on the same boot, and the server comes back from a "reboot" with the
wall clock stepped 10 minutes either way.

Each runs the fenced workload of ``test_lock_faults.py`` (four worker processes, two keys, half
of them two-phase, a healthy client) against the real ``dflockd`` with a state directory of the
run's own, started as a user starts it (no ``--restart-grace``), and checks every hold: no
double grant, fences in grant order, FIFO, no lost update; the full disk and the reboot keep the
aimed long holds too.

- **Full disk.** The state directory is a small tmpfs this test mounts (root only: skipped
  otherwise, with the reason). A worker is asked for a hold longer than the episode; the tmpfs
  is filled to its last byte, the server must log the failed write, grants stop
  (``error_read_only``: the workers retry) while renewals and releases go on, then the filler
  is removed and grants resume by themselves.
- **Stalled disk.** The state directory is an ext4 file system of its own on a loop device
  (root only: skipped otherwise), frozen with ``fsfreeze`` for a few seconds, as a disk that
  stops answering or a snapshot tool freezes it, while a worker is inside a hold longer than
  the episode: the server's journal write waits, and with it every connection (as Redis with
  its AOF on waits: benchmarks/results/ab/issue-52-journal-share.md). No grant completes while
  it is frozen. A holder whose renewal goes unanswered past its session's window is told its
  lock is lost (the server may have seen its connection close), and its key is granted again
  only after that; every other hold is kept, none is lost silently, and grants go on once the
  file system thaws.
- **Read-only after a disk error, repaired.** The state directory is an ext4 file system of its
  own mounted ``errors=remount-ro`` (root only), failed through ext4's own error path
  (``trigger_fs_error``) just after a long hold was granted: the server refuses grants and, as
  it cannot remove its ``complete`` mark, renewals (each holder told). Then, as an operator
  does, the server is SIGKILLed, the file system unmounted, checked (``e2fsck``) and mounted
  again, and the server started in place with the same command. The grants of the last moments
  before the error were written but not yet on the disk and are gone with the old mount: the
  start must see the file system mounted anew and wait out the longest lease before granting.
- **Reboot with a clock step.** No test can reboot its machine, so the server is SIGKILLed and
  its journal rewritten as another boot would have left it: another boot id, and every wall
  time in it moved by the step (+600 s: the clock is now 10 minutes ahead of the one the journal
  was written with; -600 s: behind), then the server is started in place.
"""

from __future__ import annotations

import time
import uuid
import zlib
from pathlib import Path

from tests.faults.conftest import FaultReport, scaled
from tests.faults.history import Cut
from tests.faults.test_lock_faults import (
    DURABLE_HOLD_S,
    DURABLE_LEASE_S,
    OPS,
    RUN_TIMEOUT_S,
    across_restarts,
    checked,
    fences_by_epoch,
    long_hold,
    report,
)
from tests.faults.workload import EVENT_TIMEOUT_S, Injection, LockRun, now, read_events
from tests.support.disks import fill, frozen, own_ext4, repaired, small_tmpfs, turn_read_only

EPISODE_S = 2.0
"""How long the state directory stays full."""
STALL_S = 3.0
"""How long the state directory stays frozen: inside what a renewed lease has left
(``DURABLE_LEASE_S``, renewed at a third of it), past a session's window (a renewal unanswered
for 1.25 s of the default 3 s session: its lock counts as lost)."""


def durable_run(directory: Path, seed: int, server_args: tuple[str, ...] = ()) -> LockRun:
    """The fenced workload against ``dflockd`` with a state dir of its own (``directory /
    "state"``), leases of ``DURABLE_LEASE_S``."""
    return LockRun(
        directory,
        seed=seed,
        durable=True,
        lease_s=DURABLE_LEASE_S,
        max_lease_s=DURABLE_LEASE_S,
        server_args=server_args,
    )


def test_a_full_state_dir_under_load_frees_no_lock_and_grants_nothing_twice(
    tmp_path: Path, fault_report: FaultReport
) -> None:
    episodes = scaled(2, 6)
    aimed: list[int] = []
    with (
        small_tmpfs(tmp_path / "state", "4m") as state,
        durable_run(tmp_path, seed=47) as run,
    ):
        assert run.server.state_dir == state
        run.wait_grants(50, RUN_TIMEOUT_S)
        for _ in range(episodes):
            _, fence = long_hold(run.pick(), DURABLE_HOLD_S)
            aimed.append(fence)
            run.injections.append(Injection("state dir full", now()))
            filler = fill(state)
            proc = run.server.proc
            assert proc is not None
            proc.wait_for("journal: cannot write", RUN_TIMEOUT_S)
            time.sleep(EPISODE_S)  # holders renew and release; nothing is granted
            filler.unlink()
            proc.wait_for("can be written again", RUN_TIMEOUT_S)
            run.settle(DURABLE_HOLD_S + EVENT_TIMEOUT_S)
        run.wait_grants(run.grants() + OPS, RUN_TIMEOUT_S)
        result = run.finish()
        refused = sum(
            1
            for worker in run.all_workers()
            for event in read_events(Path(worker.cfg.history))
            if event["ev"] == "nogrant"
            and "cannot write its lease journal" in event.get("detail", "")
        )
    check = checked(result)
    by_fence = {h.fence: h for h in result.holds if h.fence is not None}
    not_kept = [by_fence[f] for f in aimed if not by_fence[f].release_ok]
    assert not not_kept, f"holds across a full disk were not kept: {not_kept}"
    assert refused > 0, "no worker was refused a grant while the disk was full"
    report(
        fault_report,
        f"state dir (a {4} MiB tmpfs) filled to its last byte under load for {EPISODE_S:.0f} s, "
        f"{episodes} times",
        result,
        check,
        f"every aimed {DURABLE_HOLD_S:.0f} s hold ({len(aimed)}) kept and released; "
        f"{refused} acquires answered error_read_only during the episodes (ServerReadOnly in "
        "the workers, which retried); the server granted again by itself each time",
    )


def test_a_stalled_state_dir_under_load_grants_nothing_twice_and_loses_nothing_silently(
    tmp_path: Path, fault_report: FaultReport
) -> None:
    episodes = scaled(2, 6)
    stalls: list[tuple[float, float]] = []
    with (
        own_ext4(tmp_path / "state", tmp_path / "state.img", "64M") as state,
        durable_run(tmp_path, seed=49) as run,
    ):
        assert run.server.state_dir == state
        run.wait_grants(50, RUN_TIMEOUT_S)
        for _ in range(episodes):
            long_hold(run.pick(), DURABLE_HOLD_S)
            run.injections.append(Injection("state dir frozen", now()))
            with frozen(state):
                began = now()
                time.sleep(STALL_S)
                ended = now()
            stalls.append((began, ended))
            run.settle(DURABLE_HOLD_S + EVENT_TIMEOUT_S)
        run.wait_grants(run.grants() + OPS, RUN_TIMEOUT_S)
        result = run.finish()
    # A holder whose renewal went unanswered past its session's window was told its lock is
    # lost, and its client closed the connection: from then on the key is the server's to free
    # (after its session time), so its hold is proven only until the client was told.
    told = [
        hold
        for hold in result.holds
        if hold.reported_lost
        and hold.told_t is not None
        and any(began <= hold.told_t <= ended + DURABLE_LEASE_S for began, ended in stalls)
    ]
    result.cuts.extend(Cut(hold.told_t, hold.client) for hold in told if hold.told_t is not None)
    check = checked(result)
    caught = [
        hold
        for hold in result.holds
        if hold.granted_t is not None
        and any(
            hold.granted_t < began and (hold.released_t is None or hold.released_t > began)
            for began, _ in stalls
        )
    ]
    silent = [
        h for h in caught if h.outcome != "killed" and not h.release_ok and not h.reported_lost
    ]
    assert not silent, f"holds lost across a stalled disk without a word: {silent}"
    # The fault was real: no grant reached a client in the heart of a freeze (one the server
    # wrote just before it may still be on its way in its first moments).
    during = [
        hold.granted_t
        for hold in result.holds
        if hold.granted_t is not None
        and any(began + 0.5 <= hold.granted_t <= ended - 0.1 for began, ended in stalls)
    ]
    assert not during, f"{len(during)} grants while the state dir was frozen: not stalled"
    kept = sum(1 for hold in caught if hold.release_ok)
    lost = sum(1 for hold in caught if hold.reported_lost)
    report(
        fault_report,
        f"state dir (ext4 on a loop device) frozen under load for {STALL_S:.0f} s, "
        f"{episodes} times",
        result,
        check,
        f"no grant reached a client while the disk was frozen (every connection waits for the "
        f"journal's write, as Redis with AOF waits); of the {len(caught)} holds held as a "
        f"freeze began, {kept} kept and {lost} reported lost to their client (a renewal "
        f"unanswered past its session's window); {len(told)} holds in all reported lost across "
        "the freezes, each before its key was granted again; none lost silently; grants went "
        "on once it thawed",
    )


READ_ONLY_OPTIONS = "errors=remount-ro"
"""How the test's ext4 is mounted: a disk error remounts it read-only (Debian's choice for its
root file system; ext4's default is to carry on)."""


def test_a_state_dir_turned_read_only_by_a_disk_error_grants_nothing_twice(
    tmp_path: Path, fault_report: FaultReport
) -> None:
    episodes = scaled(2, 4)
    image = tmp_path / "state.img"
    with (
        own_ext4(tmp_path / "state", image, "64M", options=READ_ONLY_OPTIONS) as state,
        # The default sweep (the everysec fsync is asked for at each): a grant's record may
        # wait up to a second for the disk, as it does in a user's server.
        durable_run(tmp_path, seed=50, server_args=("--lease-sweep-interval", "1")) as run,
    ):
        assert run.server.state_dir == state
        run.wait_grants(50, RUN_TIMEOUT_S)
        for _ in range(episodes):
            long_hold(run.pick(), DURABLE_HOLD_S)  # its grant's record: maybe not on disk yet
            run.injections.append(Injection("state dir turned read-only", now()))
            turn_read_only(state)
            proc = run.server.proc
            assert proc is not None
            proc.wait_for("journal: cannot write", RUN_TIMEOUT_S)
            # The complete mark cannot be removed either: renewals are refused too; the log says
            # what to do. Each line may come before or after the first ("cannot write"): one not
            # read yet is waited for (checked at once, CI read the log too early, loaded).
            for needle in ("cannot remove", "cannot resume by itself"):
                if not any(needle in line for line in proc.lines):
                    proc.wait_for(needle, RUN_TIMEOUT_S)
            time.sleep(EPISODE_S)  # nothing granted; holders' renewals refused
            # The operator: stop the server, repair the file system, start the server again in
            # place with the same command.
            run.kill_server()
            repaired(state, image, READ_ONLY_OPTIONS)
            run.server.start()
            assert run.server.proc is not None
            started = run.server.proc.drain()
            # (every line: the restore's own line says which rule it took)
            assert any("mounted anew" in line for line in started), "\n".join(started)
            run.settle(DURABLE_HOLD_S + DURABLE_LEASE_S + EVENT_TIMEOUT_S)
        run.wait_grants(run.grants() + OPS, RUN_TIMEOUT_S)
        result = run.finish()
    told = sum(1 for hold in result.holds if hold.reported_lost)
    check = checked(result)
    caught = across_restarts(result)
    assert not caught.silent, f"holds lost without a word to their client: {caught.silent}"
    for before, after in fences_by_epoch(result):
        assert before and after
        assert min(after) > max(before)
    report(
        fault_report,
        f"state dir (ext4 on a loop device, {READ_ONLY_OPTIONS}) turned read-only by a disk error "
        "under load, then the server SIGKILLed, the file system repaired (e2fsck) and the "
        f"server started again in place with the same command ({episodes} times)",
        result,
        check,
        f"no grant while read-only (acquires answered error_read_only); renewals refused (the "
        f"journal's complete mark could not be removed): {told} holds told lost; "
        f"{len(caught.kept)} holds caught by the stops kept, {len(caught.reported)} reported "
        f"lost, {len(caught.let_go)} let go, {len(caught.silent)} lost silently; each start saw "
        "the file system mounted anew and waited out the longest lease before granting, so the "
        "grants the repair lost (written, not yet on the disk) were not given again",
    )


def as_if_rebooted(journal: Path, step_s: int) -> None:
    """Rewrite ``journal`` as a server of another boot would have left it, with a wall clock
    ``step_s`` behind the one now (every wall time in it moved by ``-step_s``)."""
    shift = -step_s * 1000
    other_boot = uuid.uuid4().hex
    out: list[bytes] = []
    for raw in journal.read_bytes().splitlines():
        payload = raw[9:].decode()
        fields = payload.split(" ")
        kind = fields[0]
        if kind == "H":
            fields[2] = other_boot
            fields[3] = str(int(fields[3]) + shift)
        elif kind == "G":
            fields[6] = str(int(fields[6]) + shift)
        elif kind == "X":
            fields[3] = str(int(fields[3]) + shift)
        elif kind == "M":
            fields[5] = str(int(fields[5]) + shift)
        data = " ".join(fields).encode()
        out.append(b"%08x %s\n" % (zlib.crc32(data), data))
    journal.write_bytes(b"".join(out))


def test_a_reboot_with_the_wall_clock_stepped_grants_nothing_twice(
    tmp_path: Path, fault_report: FaultReport
) -> None:
    steps = [600, -600] * scaled(1, 3)
    aimed: list[int] = []
    with durable_run(tmp_path, seed=48) as run:
        state_dir = run.server.state_dir
        assert isinstance(state_dir, Path)
        run.wait_grants(50, RUN_TIMEOUT_S)
        for step in steps:
            _, fence = long_hold(run.pick(), DURABLE_HOLD_S)
            aimed.append(fence)
            run.kill_server()
            as_if_rebooted(state_dir / "journal", step)
            run.server.start()
            assert run.server.proc is not None
            assert any("another boot" in line for line in run.server.proc.drain()), (
                run.server.proc.lines
            )
            run.settle(DURABLE_HOLD_S + EVENT_TIMEOUT_S)
        run.wait_grants(run.grants() + OPS, RUN_TIMEOUT_S)
        result = run.finish()
    check = checked(result)
    for before, after in fences_by_epoch(result):
        assert before and after
        assert min(after) > max(before)
    caught = across_restarts(result)
    assert not caught.silent, f"holds lost without a word to their client: {caught.silent}"
    by_fence = {h.fence: h for h in result.holds if h.fence is not None}
    not_kept = [by_fence[f] for f in aimed if by_fence[f] not in caught.kept]
    assert not not_kept, f"holds across a reboot were not kept: {not_kept}"
    report(
        fault_report,
        "server SIGKILL, journal rewritten as another boot left it with the wall clock "
        f"10 min ahead, then behind ({len(steps)} restarts in place)",
        result,
        check,
        f"{len(caught.kept)} holds caught by the stops kept, {len(caught.reported)} reported "
        f"lost, {len(caught.let_go)} let go while the server was away, {len(caught.silent)} "
        f"lost silently (the {len(aimed)} aimed "
        f"{DURABLE_HOLD_S:.0f} s holds kept); each start restored every lease for a full lease "
        "and, the journal being everysec, granted nothing for the longest lease",
    )
