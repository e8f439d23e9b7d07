"""A holder paused past the server's read timeout (issue 47): the server closes its silent
connection, its own act, which frees nothing early; the holder, on resuming, does not claim
``owned()`` without a fresh answer from the server, and reports the lock lost (once lost, lost)
rather than believe in a grant it has not heard of since before its session's deadline.

Against the ``dflockd`` console script, with the project's own client in a child process that
the test stops with SIGSTOP."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.support.servers import DflockdProcess
from tests.support.wire import Wire

PAUSE_S = 5.0
"""Past the read timeout (1 s) and the session time (3 s)."""

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from celery_dflock.client import Client

    client = Client([(sys.argv[1], int(sys.argv[2]))])
    lock = client.lock("k", lease_ttl_s=60)
    assert lock.acquire()
    print("held", flush=True)
    while True:
        t = time.monotonic()  # before owned(): a line stamped after a resume was decided after it
        print(f"{t:.6f} {int(lock.owned())} {int(lock.lost)}", flush=True)
        time.sleep(0.05)
    """
)


@pytest.fixture
def dflockd() -> Iterator[tuple[str, int]]:
    proc = DflockdProcess(
        ["--host", "127.0.0.1", "--port", "0", "--read-timeout", "1", "--state-dir", "none"],
        {},
    )
    try:
        yield proc.wait_listening()
    finally:
        proc.kill()


def _lines_until(proc: subprocess.Popen[str], done: float) -> list[tuple[float, bool, bool]]:
    """The child's ``(time, owned, lost)`` lines read until ``done`` (monotonic)."""
    assert proc.stdout is not None
    out: list[tuple[float, bool, bool]] = []
    while time.monotonic() < done:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            break
        t, owned, lost = line.split()
        out.append((float(t), owned == "1", lost == "1"))
    return out


def test_a_holder_paused_past_the_read_timeout_does_not_claim_it_owns_the_lock(
    dflockd: tuple[str, int],
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, dflockd[0], str(dflockd[1])],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(PAUSE_S)
        with Wire(dflockd) as rival:
            # The server closed the paused holder's connection (read timeout): its own act,
            # so the key is still held.
            assert rival.req("l", "k", "0") == "timeout"
        resumed = time.monotonic()
        proc.send_signal(signal.SIGCONT)
        lines = _lines_until(proc, time.monotonic() + 15.0)
        after = [(owned, lost) for t, owned, lost in lines if t > resumed]
        assert after, lines
        assert not any(owned for owned, _ in after), after
        assert after[-1][1], "the loss was reported"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
