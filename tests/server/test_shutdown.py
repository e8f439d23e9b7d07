"""Graceful shutdown: the real ``dflockd`` process on SIGTERM and SIGINT, and an embedded
server stopped under a storm of new connections."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from dflock_proc import DflockdProcess
from dflock_wire import Wire, eventually, unclosed_after_gc

from dflockd_server import Config
from dflockd_server.testing import ServerThread


def waiters_on(wire: Wire, key: str) -> int:
    stats = json.loads(wire.req("stats").split(" ", 1)[1])
    return sum(entry["waiters"] for entry in stats["locks"] if entry["key"] == key)


def wait_queued(wire: Wire, key: str, n: int) -> None:
    eventually(lambda: waiters_on(wire, key) == n, f"{n} waiter(s) queued on {key}")


def test_sigterm_drains_in_flight_work_then_exits_0(dflockd_process: Any) -> None:
    proc: DflockdProcess = dflockd_process(
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--shutdown-timeout",
        "3",
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
        short_holder.lock("short", lease=2)
        lucky.send("l", "short", "30")  # the lease runs out during the drain: granted
        wait_queued(holder, "short", 1)

        proc.proc.send_signal(signal.SIGTERM)
        proc.wait_for("draining")
        assert holder.req("ping") == "error_draining"  # new requests are refused
        assert short_holder.req("n", "short", "x") == "error_draining"
        assert lucky.recv().startswith("ok ")  # in-flight work finished
        assert stuck.recv() == "error_draining"  # in-flight work cut off at the deadline
        assert proc.wait_exit() == 0
        for wire in (holder, stuck, short_holder, lucky):
            assert wire.closed_by_server()
    assert any("dflockd stopped" in line for line in proc.lines)


def test_sigint_with_nothing_in_flight_exits_0_at_once(dflockd_process: Any) -> None:
    proc: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", "0")
    address = proc.wait_listening()
    with Wire(address) as idle:
        idle.lock("k")
        proc.proc.send_signal(signal.SIGINT)
        assert proc.wait_exit(timeout=10) == 0  # the default 30 s drain is not waited out
        assert idle.closed_by_server()
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
        eventually(lambda: len(clients) >= 200, "the storm")
        srv.stop()
        assert srv.server.open_transports == 0
    finally:
        halt.set()
        for thread in stormers:
            thread.join()
        for client in clients:
            client.close()
    unclosed = unclosed_after_gc()
    assert not unclosed, f"{len(unclosed)} left open, e.g. {unclosed[:2]}"
