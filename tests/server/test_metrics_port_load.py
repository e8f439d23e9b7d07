"""The metrics port under clients that connect and do not finish a request (a stuck scraper,
a port scan, a slow-loris): the lock server beside it keeps serving its own clients."""

from __future__ import annotations

import contextlib
import re
import resource
import socket
import time
import urllib.request
from collections.abc import Callable

from dflockd_server import constants as c
from tests.support.servers import DflockdProcess
from tests.support.wire import Wire

OPEN_FILES = 64
"""The open-file limit the server is given for the test: fewer than the slow HTTP clients."""
SLOW_CLIENTS = 80


def test_slow_http_clients_take_no_lock_connections_away(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    """``SLOW_CLIENTS`` connections to the metrics port that never finish their request each
    took a thread and an open file, for as long as they stayed: past the open-file limit the
    lock server could accept no lock client (its connections were reset or went unanswered).
    The HTTP server now serves at most ``METRICS_MAX_HTTP_CONNECTIONS`` at once (it closes the
    others at once) and drops one silent for ``METRICS_HTTP_TIMEOUT_S``."""
    proc = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--state-dir", "none", "--restart-grace", "0",
        "--metrics-port", "0", "--max-connections", "64",
    )  # fmt: skip
    address = proc.wait_listening()
    match = re.search(r"http://(\S+):(\d+)/metrics", proc.wait_for("metrics on"))
    assert match, proc.lines
    metrics = (match.group(1), int(match.group(2)))
    resource.prlimit(proc.proc.pid, resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
    slow: list[socket.socket] = []
    try:
        for _ in range(SLOW_CLIENTS):
            try:
                sock = socket.create_connection(metrics, timeout=10)
            except OSError:  # the HTTP server's backlog is full: enough of them
                break
            slow.append(sock)
            with contextlib.suppress(OSError):  # (one closed at once by the HTTP server)
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ends it
        time.sleep(1.0)  # the server has accepted them
        for i in range(20):
            with Wire(address, timeout=5) as w:
                w.send("ping")
                assert w.recv() == "ok", i
    finally:
        for sock in slow:
            sock.close()
    deadline = time.monotonic() + c.METRICS_HTTP_TIMEOUT_S + 5
    while True:  # once the slow ones are gone, the page answers again
        try:
            with urllib.request.urlopen(f"http://{metrics[0]}:{metrics[1]}/status", timeout=5):
                break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    with socket.create_connection(metrics, timeout=c.METRICS_HTTP_TIMEOUT_S + 5) as silent:
        started = time.monotonic()
        assert silent.recv(100) == b""  # closed by the server, silent too long
        assert time.monotonic() - started < c.METRICS_HTTP_TIMEOUT_S + 5
