"""Pieces shared by the abuse tests: a real ``dflockd`` subprocess with its memory and log in
view, a sampler of its resident memory and raw-socket helpers."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import resource
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from tests.faults.conftest import FaultReport, FaultRow
from tests.faults.healthy import (
    P99_FLOOR_MS,
    Latencies,
    assert_p99_within_bound,
    compare,
    p99_bound_ms,
)
from tests.support.processes import favour
from tests.support.servers import DflockdProcess
from tests.support.waiting import wait_until
from tests.support.wire import Wire

KIB = 1024
RSS_SAMPLE_INTERVAL_S = 0.02
CONNECTION_RSS_BUDGET_KIB = 16
"""Resident memory one open connection may cost the server. Measured: about 2 KiB each with
uvloop (1,000 idle or half-sent connections add 2 MiB); the budget leaves room for the stdlib
loop and for a partial request (at most three lines of 257 bytes)."""
TLS_HANDSHAKE_RSS_BUDGET_KIB = 96
"""Resident memory one connection in its TLS handshake may cost the server: its connection
and its OpenSSL session, whose record buffers are allocated as bytes arrive. Measured: 512
stalled handshakes at once add about 21 MiB (about 40 KiB each). With the loop's own TLS
transports it was 256 KiB or more each (their read buffer), and rounds of them grew the
process to 85-115 MiB with uvloop and 150 MiB with the stdlib loop."""
RSS_SLACK_KIB = 8 * KIB
"""Allocator arenas and caches that a Python process keeps after a burst of work."""
STOP_TIMEOUT_S = 30.0
DROP_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 10.0
LOG_PROBLEM_MARKERS = (" ERROR ", " CRITICAL ", "Traceback", "Exception in callback")
HUNG_UP = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)
"""What sending to a connection the server has already closed raises."""
ABUSE_TIMEOUT_S = 100.0

T = TypeVar("T")


def run_abuser(abuse: Callable[[], T], timeout: float = ABUSE_TIMEOUT_S) -> T:
    """Run ``abuse`` in a thread of its own under the ``SCHED_IDLE`` policy, and return what
    it returns (or raise what it raised; fail if it runs past ``timeout`` seconds).

    The abuser shares this machine's two cores with the server and the healthy client, which a
    real attacker, on another machine, does not. Each byte it sends wakes the server, and the
    scheduler places a task it wakes on the waker's core: server and abuser end up on one
    core. At equal priority, or even at nice +10, the server then waits there behind the
    abuser's time slice while the other core is idle; ``perf sched`` showed the server woken
    by the healthy client's request and kept waiting 2.4 ms behind the niced abuser, and the
    healthy p99 measured that, not the server. A ``SCHED_IDLE`` thread gives up its core the
    moment anything else wants it, so it gets the CPU the other two leave and the healthy p99
    measures the server's own work for the abuse.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        try:
            outcome.append(abuse())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=body, name="abuser", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"the abuse did not end within {timeout} s")
    if failure:
        raise failure[0]
    return outcome[0]


def rss_kib(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def rss_bound_kib(baseline_kib: int, connections: int) -> int:
    """What the server may hold while ``connections`` abusive connections are open."""
    return baseline_kib + connections * CONNECTION_RSS_BUDGET_KIB + RSS_SLACK_KIB


class ServerProcess(DflockdProcess):
    """The real ``dflockd`` on 127.0.0.1 (any free port), its log kept for inspection."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(["--host", "127.0.0.1", "--port", "0", *args], env or {})
        self.address: tuple[str, int] = self.wait_listening()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def drain_log(self) -> list[str]:
        """Every log line so far (without waiting for more)."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return self.lines

    def log_problems(self) -> list[str]:
        """Log lines that show an error or an unhandled exception."""
        return [
            line
            for line in self.drain_log()
            if any(marker in line for marker in LOG_PROBLEM_MARKERS)
        ]

    def assert_healthy(self) -> None:
        """Still running, and nothing in its log shows an unhandled exception."""
        code = self.proc.poll()
        assert code is None, f"dflockd exited with {code}: {self.drain_log()[-20:]}"
        problems = self.log_problems()
        assert not problems, f"dflockd logged errors: {problems[:20]}"

    def stop(self) -> int:
        """SIGTERM (graceful shutdown) and wait; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait_exit(STOP_TIMEOUT_S)
        finally:
            self.kill()


@contextlib.contextmanager
def dflockd(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A running ``ServerProcess``; on a clean exit of the block it must stop cleanly with
    nothing logged at error level."""
    server = ServerProcess(list(args), env)
    favour(server.pid)  # measured against the abuse, not against the rest of the suite
    try:
        yield server
        server.assert_healthy()
        code = server.stop()
        problems = server.log_problems()
        assert code == 0 and not problems, f"dflockd exit {code}, logged {problems[:20]}"
    finally:
        server.kill()


class RssWatch:
    """Samples a process's resident memory every ``RSS_SAMPLE_INTERVAL_S`` in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = rss_kib(pid)
        self.samples = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_INTERVAL_S):
            with contextlib.suppress(OSError):  # the process may be gone at the very end
                self.peak_kib = max(self.peak_kib, rss_kib(self.pid))
                self.samples += 1

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


# ---------------------------------------------------------------------- talking to the server
def connect(
    address: tuple[str, int], source_ip: str | None = None, timeout: float = CONNECT_TIMEOUT_S
) -> socket.socket:
    """A raw TCP connection (from ``source_ip``, any 127.x.y.z, when given)."""
    source = (source_ip, 0) if source_ip is not None else None
    sock = socket.create_connection(address, timeout=timeout, source_address=source)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_line(sock: socket.socket, timeout: float = REPLY_TIMEOUT_S) -> bytes:
    """One reply line (without its newline); ``b""`` when the server closed or reset first."""
    data = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no reply line within {timeout} s (got {bytes(data)!r})")
            sock.settimeout(left)
            chunk = sock.recv(1)
            if not chunk:
                return b""
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return b""
    return bytes(data[:-1])


def client_context(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


def open_wire(
    address: tuple[str, int],
    secret: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Wire:
    """A ``Wire``, authenticated when a secret is given."""
    wire = Wire(address, ssl_context=ssl_context)
    if secret is not None:
        assert wire.req("auth", "_", secret) == "ok"
    return wire


def server_stats(
    address: tuple[str, int],
    secret: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    """The server's ``stats`` on a fresh connection (which it counts)."""
    with open_wire(address, secret, ssl_context) as wire:
        reply = wire.req("stats")
    assert reply.startswith("ok "), reply
    return cast(dict[str, Any], json.loads(reply[3:]))


def wait_for_connections(
    address: tuple[str, int],
    expected: int,
    timeout: float = DROP_TIMEOUT_S,
    secret: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> float:
    """Wait until the server counts ``expected`` connections besides the asking one; the
    seconds it took."""

    def settled() -> bool:
        try:
            return server_stats(address, secret, ssl_context)["connections"] - 1 == expected
        except (EOFError, OSError):  # refused while a flood still fills the cap
            return False

    start = time.monotonic()
    wait_until(settled, timeout=timeout, what=f"{expected} connection(s) left on the server")
    return time.monotonic() - start


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True when the server closed ``sock`` (EOF or reset) within ``timeout``, reading and
    discarding whatever it sent first."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes: (bytes, closed within ``timeout``)."""
    data = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(data), False
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                return bytes(data), True
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return bytes(data), True
    except TimeoutError:
        return bytes(data), False


def raise_fd_limit(needed: int) -> None:
    """Make room for ``needed`` open files in this process and the servers it starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


# ---------------------------------------------------------------------- the verdict
def judge_abuse(
    report: FaultReport,
    fault: str,
    *,
    runs: int,
    operations: int,
    quiet: Latencies,
    under: Latencies,
    baseline_kib: int,
    rss: RssWatch,
    after_kib: int,
    bound_kib: int,
    details: str,
    recovery_s: float | None = None,
    double_grants: int | None = None,
    after_bound_kib: int | None = None,
    p99_floor_ms: float = P99_FLOOR_MS,
) -> None:
    """Add the fault's row to the report, then hold the server to acceptance 3: the healthy
    p99 under the abuse stays below its bound, memory stays below ``bound_kib`` during the
    abuse and, after it, below ``after_bound_kib`` (default: within ``RSS_SLACK_KIB`` of the
    baseline)."""
    if after_bound_kib is None:
        after_bound_kib = baseline_kib + RSS_SLACK_KIB
    p99_bound = p99_bound_ms(quiet, p99_floor_ms)
    floor = f", quiet p99 floored at {p99_floor_ms:g} ms" if quiet.p99 < p99_floor_ms else ""
    observed = (
        f"{details}; {compare(quiet, under)} (bound {p99_bound:.2f} ms{floor}); "
        f"server RSS {baseline_kib / KIB:.1f} MiB before, "
        f"peak {rss.peak_kib / KIB:.1f} MiB (bound {bound_kib / KIB:.1f}), "
        f"{after_kib / KIB:.1f} MiB after"
    )
    print(f"{fault}: {runs} runs, {operations} operations; {observed}")  # shown by -rP
    report.add(
        FaultRow(
            fault=fault,
            runs=runs,
            operations=operations,
            double_grants=double_grants,
            recovery_s=recovery_s,
            healthy_p99_ms=under.p99,
            observed=observed,
        )
    )
    assert rss.peak_kib <= bound_kib, f"{fault}: {observed}"
    assert after_kib <= after_bound_kib, f"{fault}: {observed}"
    assert_p99_within_bound(quiet, under, fault, p99_floor_ms)
