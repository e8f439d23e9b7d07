"""Graceful shutdown: the real ``dflockd`` process on SIGTERM and SIGINT, and an embedded
server stopped under a storm of new connections."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.servers import DflockdProcess
from tests.support.waiting import wait_until
from tests.support.wire import Wire, unclosed_after_gc


def waiters_on(wire: Wire, key: str) -> int:
    stats = json.loads(wire.req("stats").split(" ", 1)[1])
    return sum(entry["waiters"] for entry in stats["locks"] if entry["key"] == key)


def wait_queued(wire: Wire, key: str, n: int) -> None:
    wait_until(lambda: waiters_on(wire, key) == n, what=f"{n} waiter(s) queued on {key}")


SHORT_LEASE_S = 4
"""The lease of ``short`` in the SIGTERM test: it must outlive the wait for its waiter, the
signal and the start of the drain (2 s was too little for a loaded CI machine), and end
during the drain."""
SIGTERM_DRAIN_S = 5
"""That test's drain: every request after the drain began is answered in it, and the lease of
``short`` ends in it (with a second to spare). The test waits all of it (``held`` is never
released), so no longer than that."""


def test_sigterm_drains_in_flight_work_then_exits_0(dflockd_process: Any) -> None:
    proc: DflockdProcess = dflockd_process(
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--shutdown-timeout",
        str(SIGTERM_DRAIN_S),
        "--lease-sweep-interval",
        "0.1",
    )
    address = proc.wait_listening()
    with (
        Wire(address) as holder,
        Wire(address) as stuck,
        Wire(address) as short_holder,
        Wire(address) as lucky,
    ):
        holder.lock("held", lease=60)
        stuck.send("l", "held", "30")  # its lock is never freed: answered at the deadline
        wait_queued(holder, "held", 1)
        short_holder.lock("short", lease=SHORT_LEASE_S)
        lucky.send("l", "short", "30")  # the lease runs out during the drain: not granted
        wait_queued(holder, "short", 1)

        proc.proc.send_signal(signal.SIGTERM)
        proc.wait_for("draining")
        # Waiters are refused at once: nothing is granted while the server drains.
        assert stuck.recv() == "error_draining"
        assert lucky.recv() == "error_draining"
        assert holder.req("l", "new", "0") == "error_draining"  # new acquires are refused
        assert holder.req("ping") == "ok"  # holders still talk to it
        assert short_holder.req("n", "short", "x") == "error"  # a wrong token, as always
        assert proc.wait_exit() == 0  # "held" is never released: closed at the deadline
        for wire in (holder, stuck, short_holder, lucky):
            assert wire.closed_by_server()
    assert any("dflockd stopped" in line for line in proc.lines)


HOLDERS = 1000
WAITERS = 1000
CONNECTIONS = 10


def test_a_drain_lets_holders_release_refuses_waiters_and_exits_when_done(
    dflockd_process: Any,
) -> None:
    """1,000 held locks and 1,000 waiters, SIGTERM: every waiter is refused cleanly at once,
    every holder releases during the drain, and the process exits as soon as the last lock is
    released, long before the shutdown timeout."""
    proc: DflockdProcess = dflockd_process(
        # Each connection holds and queues on many keys: no per-connection caps.
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--shutdown-timeout",
        "60",
        "--max-locks",
        "5000",
        "--max-locks-per-connection",
        "0",
        "--max-waits-per-connection",
        "0",
    )
    address = proc.wait_listening()
    holders = [Wire(address) for _ in range(CONNECTIONS)]
    queuers = [Wire(address) for _ in range(CONNECTIONS)]
    blocked = [Wire(address) for _ in range(CONNECTIONS)]
    try:
        tokens: list[tuple[Wire, str, str]] = []
        for n in range(HOLDERS):
            wire = holders[n % CONNECTIONS]
            tokens.append((wire, f"drain:{n}", wire.lock(f"drain:{n}", lease=60)))
        for n in range(WAITERS - CONNECTIONS):  # two-phase: queued without blocking
            assert queuers[n % CONNECTIONS].req("e", f"drain:{n}") == "queued"
        for n, wire in enumerate(blocked):  # and some blocked in an acquire
            wire.send("l", f"drain:{HOLDERS - 1 - n}", "60")
        wait_until(
            lambda: (
                sum(e["waiters"] for e in json.loads(holders[0].req("stats")[3:])["locks"])
                == WAITERS
            ),
            what="every waiter queued",
        )

        proc.proc.send_signal(signal.SIGTERM)
        proc.wait_for("draining")
        for wire in blocked:
            assert wire.recv() == "error_draining"
        for n in range(WAITERS - CONNECTIONS):
            assert queuers[n % CONNECTIONS].req("w", f"drain:{n}", "0") in (
                "error_draining",
                "error_not_enqueued",
            )
        started = time.monotonic()
        for wire, key, token in tokens:
            assert wire.req("r", key, token) == "ok"  # releases work during the drain
        assert proc.wait_exit(timeout=30) == 0
        print(f"exited {time.monotonic() - started:.2f}s after the releases began")
        assert any("draining: 1000 lock(s) held" in line for line in proc.lines)
        assert not any("shutdown timeout reached" in line for line in proc.lines)
    finally:
        for wire in (*holders, *queuers, *blocked):
            wire.close()


def test_the_drain_log_counts_every_waiter_it_refuses(dflockd_process: Any) -> None:
    """The start-of-drain line counts the acquires blocked in a wait as well as the two-phase
    enqueues: both are refused."""
    proc: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", "0")
    address = proc.wait_listening()
    with Wire(address) as holder, Wire(address) as queuer, Wire(address) as blocked:
        token = holder.lock("drain:log", lease=60)
        assert queuer.req("e", "drain:log") == "queued"
        blocked.send("l", "drain:log", "60")
        wait_queued(holder, "drain:log", 2)
        proc.proc.send_signal(signal.SIGTERM)
        line = proc.wait_for("draining:")
        assert blocked.recv() == "error_draining"
        assert holder.req("r", "drain:log", token) == "ok"
        assert proc.wait_exit(timeout=30) == 0
    assert "draining: 1 lock(s) held, 2 waiter(s) refused" in line


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP])
def test_sigint_or_sighup_with_nothing_held_exits_0_at_once(
    dflockd_process: Any, stop: signal.Signals
) -> None:
    """dflockd reloads nothing: SIGHUP (a closed terminal, a supervisor's stop) drains and
    exits 0 as SIGINT does, where Python's default ended the process at once, as a crash."""
    proc: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", "0")
    address = proc.wait_listening()
    with Wire(address) as idle:
        token = idle.lock("k")
        assert idle.req("r", "k", token) == "ok"
        proc.proc.send_signal(stop)
        assert proc.wait_exit(timeout=10) == 0  # the default 30 s drain is not waited out
        assert idle.closed_by_server()
    assert any("signal received: draining" in line for line in proc.lines)
    assert not any("Traceback" in line for line in proc.lines)


def test_a_lock_never_released_is_closed_at_the_shutdown_timeout(dflockd_process: Any) -> None:
    # The refusal below must come before the deadline, after the drain's log line was read:
    # 3 s, not 1 s, for a loaded CI machine. The test waits the whole drain, so no longer.
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--shutdown-timeout", "3"
    )
    address = proc.wait_listening()
    with Wire(address) as idle, Wire(address) as other:
        idle.lock("k")
        proc.proc.send_signal(signal.SIGINT)
        proc.wait_for("draining")
        assert other.req("l", "k", "0") == "error_draining"
        assert proc.wait_exit(timeout=10) == 0
        assert idle.closed_by_server()  # its lock released with the connection
    assert any("shutdown timeout reached with 1 lock(s) held" in line for line in proc.lines)
    assert not any("Traceback" in line for line in proc.lines)


def test_a_second_signal_ends_the_drain_at_once(dflockd_process: Any) -> None:
    """An operator who does not want to wait out the drain signals again: every connection
    closes now, a held lock's included."""
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--shutdown-timeout", "600"
    )
    address = proc.wait_listening()
    with Wire(address) as holder:
        holder.lock("k")
        proc.proc.send_signal(signal.SIGTERM)
        proc.wait_for("draining")
        proc.proc.send_signal(signal.SIGINT)
        assert proc.wait_exit(timeout=30) == 0  # not the 600 s drain
        assert holder.closed_by_server()
    assert any("second signal received" in line for line in proc.lines)
    assert not any("Traceback" in line for line in proc.lines)


def test_stop_under_a_connection_storm_closes_every_socket(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # Connections accepted just before the listener closed are refused and closed before
    # stop() returns; none is left for the garbage collector (an embedded server used to leave
    # up to a backlog's worth of accepted sockets open on asyncio's loop).
    srv = ServerThread(Config(host="127.0.0.1", port=0), loop_factory=loop_factory).start()
    address = srv.address
    halt = threading.Event()
    clients: list[socket.socket] = []

    def storm() -> None:
        while not halt.is_set():
            with contextlib.suppress(OSError):
                clients.append(socket.create_connection(address, timeout=1.0))

    stormers = [threading.Thread(target=storm) for _ in range(3)]
    for thread in stormers:
        thread.start()
    try:
        wait_until(lambda: len(clients) >= 200, what="the storm")
        srv.stop()
        assert srv.server.admission.open_transports == 0
    finally:
        halt.set()
        for thread in stormers:
            thread.join()
        for client in clients:
            client.close()
    unclosed = unclosed_after_gc()
    assert not unclosed, f"{len(unclosed)} left open, e.g. {unclosed[:2]}"


def test_a_server_thread_that_gives_up_its_start_leaves_no_thread_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ServerThread.start`` gave up after its timeout and left the thread (and its server's
    start) running behind the error."""
    from dflockd_server import testing
    from dflockd_server.net import Server

    started = threading.Event()

    async def start_that_hangs(self: Server) -> None:
        del self
        started.set()
        await asyncio.sleep(3600)

    monkeypatch.setattr(testing, "_START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(Server, "start", start_that_hangs)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="did not start in time"):
        ServerThread(Config(host="127.0.0.1", port=0, state_dir="none")).start()
    assert started.is_set()
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
