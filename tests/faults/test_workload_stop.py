"""The fault workers' stop request: it survives a SIGTERM at any moment of a wait, and its
waits count the time their process was stopped."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from tests.faults.workload import StopRequest

    kind = sys.argv[1]
    stopping = threading.Event() if kind == "event" else StopRequest()
    signal.signal(signal.SIGUSR1, lambda signum, frame: stopping.set())
    print("ready", flush=True)
    end = time.monotonic() + float(sys.argv[2])
    waits = 0
    while time.monotonic() < end:
        stopping.wait(0.0001)  # the worker loop's waits, as often as possible
        waits += 1
    # Finalization puts back the default action (death) for SIGUSR1: a signal still on its
    # way would kill a child that got through the storm.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    print("done", waits, flush=True)
    """
)
HOLD_S = 2.0
STOPPED_S = 1.5
STOPPED_CHILD = textwrap.dedent(
    f"""
    import time
    from tests.faults.workload import StopRequest

    stopping = StopRequest()
    print("ready", flush=True)
    started = time.monotonic()
    stopping.wait({HOLD_S})
    print(time.monotonic() - started, flush=True)
    """
)
SIGNAL_GAP_S = 0.0001
"""Between two signals: a handler is done before the next one comes (no nesting)."""
STORM_S = 2.5
RUN_S = 4.0
"""The child waits in its loop this long, past the storm, however slowly the signals go."""
MIN_SIGNALS = 1_000
"""Fewer than this and the storm proves nothing (about 10,000 on a quiet machine)."""
HANG_S = 30.0


@contextlib.contextmanager
def _child(source: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], IO[str]]]:
    """A Python child running ``source`` (from the repository, so that it can import
    ``tests.faults.workload``), once it has printed its first line; killed on the way out."""
    child = subprocess.Popen(
        [sys.executable, "-c", source, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        yield child, child.stdout
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _storm(kind: str) -> tuple[int | None, int]:
    """Run a child that waits in a loop while it gets signals for ``STORM_S``: its exit code
    (None if it hung) and how many signals it was sent. The storm ends before the child's
    loop does, however slow the machine: the signals are counted by the clock."""
    sent = 0
    with _child(CHILD, kind, str(RUN_S)) as (child, _):
        end = time.monotonic() + STORM_S
        while time.monotonic() < end and child.poll() is None:
            child.send_signal(signal.SIGUSR1)
            sent += 1
            time.sleep(SIGNAL_GAP_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(HANG_S)
        return child.poll(), sent


def test_stop_request_survives_a_signal_storm() -> None:
    code, sent = _storm("stop-request")
    assert sent >= MIN_SIGNALS, f"only {sent} signals: the storm proves nothing"
    assert code == 0


def test_an_event_set_from_the_handler_breaks_the_loop() -> None:
    # The control: what the workers used before. A handler that runs inside the loop's own
    # Event.wait, while the wait holds the event's lock, blocks on that lock for good. One
    # SIGTERM at that moment hangs the worker; in a storm, each further signal nests another
    # blocked handler until the child dies of it.
    code, _ = _storm("event")
    assert code != 0


def test_a_wait_counts_the_time_its_process_was_stopped() -> None:
    # A worker paused (SIGSTOP) inside a hold resumes at SIGCONT as if the pause had been
    # part of the hold, as the fault tests assume (a select timeout would restart afresh).
    with _child(STOPPED_CHILD) as (child, out):
        child.send_signal(signal.SIGSTOP)
        time.sleep(STOPPED_S)
        child.send_signal(signal.SIGCONT)
        waited = float(out.readline())
        assert waited < HOLD_S + 1.0, waited
