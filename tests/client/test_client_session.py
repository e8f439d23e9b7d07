"""A holder paused past its client session's time: the server ends the session and frees its
keys (its connection's close by the read timeout freed nothing: the server's own act); the
holder, on resuming, does not claim ``owned()`` without a fresh answer from the server, and
reports the lock lost (once lost, lost) rather than believe in a grant it has not heard of since
before its session's deadline. And a server down longer than the session: nothing ends there,
the holder reattaches by token once it is back.

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
from pathlib import Path

import pytest

from celery_dflock.client import Client
from tests.support.ports import free_port
from tests.support.servers import DflockdProcess, dflockd_subprocess
from tests.support.waiting import wait_until
from tests.support.wire import Wire

SESSION_S = 3
"""The holders' client session (``session_ttl_s``; the default is 15 s)."""
PAUSE_S = 5.0
"""Past the read timeout (1 s) and the session time (3 s)."""

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from celery_dflock.client import Client

    client = Client([(sys.argv[1], int(sys.argv[2]))], session_ttl_s=int(sys.argv[3]))
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
        [sys.executable, "-c", _HOLDER, dflockd[0], str(dflockd[1]), str(SESSION_S)],
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
            # Its session not kept alive for its 3 s, the server ended it: the key is free.
            assert rival.req("l", "k", "0").startswith("ok ")
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


def test_a_holder_keeps_its_lock_across_a_server_down_longer_than_the_session_time(
    tmp_path: Path,
) -> None:
    """kill -9 of a durable server, restarted in place after longer than the session time:
    the holder's reconnections were refused (nobody listened), so it knew the server could
    free nothing meanwhile, and it renews by token once the server is back (the journal
    restored the grant)."""
    port = free_port()
    args = ["--state-dir", str(tmp_path / "state")]
    client = Client([("127.0.0.1", port)], session_ttl_s=SESSION_S)
    try:
        with dflockd_subprocess(tmp_path / "first.log", *args, port=port) as (server, _):
            lock = client.lock("k", lease_ttl_s=60)
            assert lock.acquire()
            server.send_signal(signal.SIGKILL)
            server.wait(10)
            time.sleep(PAUSE_S)  # past the session's deadline: reconnections are refused
            assert not lock.owned()  # no answer for that long: not known to be held
        with dflockd_subprocess(tmp_path / "second.log", *args, port=port) as (_, address):
            wait_until(lock.owned, timeout=30.0, what="the lock reattached")
            assert not lock.lost
            with Wire(address) as rival:
                assert rival.req("l", "k", "0") == "timeout"
            assert lock.release()
    finally:
        client.close()
