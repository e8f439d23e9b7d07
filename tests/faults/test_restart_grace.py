"""Two holders across a server restart that cannot restore the leases (issue 14, point 1,
acceptance 1; issue 26).

A holds a key through the real client (renewal thread on), the lock server process is killed
with SIGKILL or stopped with SIGTERM and started again on the same port, and B asks for the key
at once. The restarted server knows nothing of A's lease: it runs without a state dir
(``--state-dir none``, the fence ceiling in a fence state file), or its state dir lost its lease
journal (deleted) or has it damaged before its last record. Its restart grace must keep B
waiting until A's lease has surely ended, unless A had already been told that its lock is lost.
(A restart that restores the leases is tests/faults/test_lock_faults.py::
test_server_restart_in_place_keeps_its_leases and tests/server/test_durable_restart.py.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from celery_dflock import DistributedLock
from tests.faults.conftest import FaultReport, FaultRow, scaled
from tests.support.ports import free_port
from tests.support.servers import DflockdProcess

LEASE_S = 2
MAX_LEASE_S = 3
WAIT_S = 30
"""B's acquire timeout: far beyond the grace, so B is granted, never timed out."""


def _start(args: list[str]) -> DflockdProcess:
    proc = DflockdProcess(args, {})
    proc.wait_listening()
    return proc


STATES = {
    "no-state": "without a state dir",
    "journal-missing": "state dir without its journal",
    "journal-damaged": "journal damaged before its last record",
}


def _spoil(state_dir: Path, state: str) -> None:
    """What happened to the state dir while the server was down."""
    journal = state_dir / "journal"
    assert journal.is_file(), sorted(state_dir.iterdir())
    if state == "journal-missing":
        journal.unlink()
    elif state == "journal-damaged":
        lines = journal.read_bytes().splitlines(keepends=True)
        assert len(lines) >= 2, lines  # the first line is not the last one
        first = lines[0]
        lines[0] = (b"1" if first[:1] != b"1" else b"2") + first[1:]  # its CRC no longer checks
        journal.write_bytes(b"".join(lines))


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("stop", ["sigkill", "sigterm"])
def test_no_second_holder_across_a_server_restart(
    tmp_path: Path, fault_report: FaultReport, stop: str, state: str
) -> None:
    port = free_port()
    address = ("127.0.0.1", port)
    state_dir = tmp_path / "state"
    args = [
        "--host", "127.0.0.1", "--port", str(port),
        "--max-lease-ttl", str(MAX_LEASE_S), "--default-lease-ttl", str(LEASE_S),
        "--lease-sweep-interval", "0.1", "--shutdown-timeout", "1",
    ]  # fmt: skip
    if state == "no-state":
        args += ["--state-dir", "none", "--fence-state-file", str(tmp_path / "fence.state")]
    else:
        args += ["--state-dir", str(state_dir)]
    runs = scaled(1, 5)
    waited: list[float] = []
    procs: list[DflockdProcess] = []
    try:
        procs.append(_start(args))
        for run in range(runs):
            lost_at: list[float] = []

            def on_lost(_lock: DistributedLock, lost_at: list[float] = lost_at) -> None:
                lost_at.append(time.monotonic())  # called once, from the renewal thread

            a = DistributedLock(f"k{run}", servers=[address], lease_ttl_s=LEASE_S, on_lost=on_lost)
            assert a.acquire()
            # Every lease A's server granted or renewed ran out by stopped_t + LEASE_S.
            stopped_t = time.monotonic()
            if stop == "sigkill":
                procs[-1].kill()
            else:
                procs[-1].proc.send_signal(signal.SIGTERM)
                assert procs[-1].wait_exit() == 0
            if state != "no-state":
                _spoil(state_dir, state)
            procs.append(_start(args))
            assert any("restart grace: granting no key" in line for line in procs[-1].lines)
            b = DistributedLock(f"k{run}", servers=[address], acquire_timeout_s=WAIT_S)
            asked_t = time.monotonic()
            assert b.acquire()
            granted_t = time.monotonic()
            told_first = bool(lost_at) and lost_at[0] < asked_t
            assert granted_t >= stopped_t + LEASE_S or told_first, (
                f"B was granted {granted_t - stopped_t:.3f} s after the server stopped, inside "
                f"A's lease of {LEASE_S} s, and A had not been told its lock was lost"
            )
            assert a.lost_event.wait(WAIT_S)  # A hears of it too
            assert not a.owned()
            waited.append(granted_t - asked_t)
            b.release()
            a.release()
    finally:
        for proc in procs:
            proc.kill()
    fault_report.add(
        FaultRow(
            fault=f"lock server {stop.upper()} and restart while a lock is held, "
            f"{STATES[state]} (lease {LEASE_S} s, --max-lease-ttl {MAX_LEASE_S})",
            runs=runs,
            operations=2 * runs,
            double_grants=0,
            recovery_s=max(waited),
            observed=(
                "the restarted server granted the key to a new client only after the old "
                f"holder's lease had ended (restart grace); waits {min(waited):.2f} to "
                f"{max(waited):.2f} s"
            ),
        )
    )
