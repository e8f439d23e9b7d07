"""Abuse of the real ``dflockd`` process: slowloris, connection floods past the caps, waiters
past ``--max-waiters``, floods of over-long lines, auth brute force, TLS with the wrong
certificate.

Each test starts its own server and a healthy client (its own process, looping acquire +
release on its own key), abuses the server from a thread that only gets the CPU the others
leave (``run_abuser``: SCHED_IDLE), and samples the server's resident memory throughout. The
healthy client's cycles are split into abuse spans and quiet spans: waves of abuse alternate
with quiet interludes (``waves_of``, ``healthy.Phases``), or, for an abuse that is not cut into
waves, quiet cycles are taken just before and just after it. The verdict (``judge_abuse``): the
server did what PROTOCOL.md says to the abuser, the healthy p99 under the abuse stays below 10x
its quiet value (slowloris and fuzzing, which acceptance 3 names, to the letter; the others
with the quiet p99 floored at 1 ms, see ``healthy.P99_FLOOR_MS``), memory stays below a bound
computed from the number of abusive connections (never from the bytes they send) and comes back
to near its baseline afterwards, and the server logs no error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from dflockd_server import constants as c
from dflockd_server.fence import fence_of
from tests.faults.abuse_helpers import (
    HUNG_UP,
    KIB,
    RSS_SLACK_KIB,
    TLS_HANDSHAKE_RSS_BUDGET_KIB,
    RssWatch,
    client_context,
    closed_by_peer,
    connect,
    dflockd,
    judge_abuse,
    open_wire,
    raise_fd_limit,
    read_until_closed,
    recv_line,
    rss_bound_kib,
    run_abuser,
    server_stats,
    wait_for_connections,
)
from tests.faults.conftest import FaultReport, long_run, scaled
from tests.faults.healthy import P99_FLOOR_MS, HealthyClient, Phases
from tests.support.certificates import key_of, make_certificate
from tests.support.waiting import wait_until
from tests.support.wire import Wire

# The healthy p99 is judged against a starved abuser: CI runs these with the machine to itself.
pytestmark = pytest.mark.alone

QUIET_SAMPLES = 200
"""Quiet healthy cycles taken just before an abuse that is not cut into waves, and as many
just after it."""
PING = b"ping\n_\n_\n"
SECRET = "abuse-secret-4f1c9e7d2b"
DROP_SLACK_S = 3.0
"""How late past its deadline the server may close an abusive connection (timers, a loaded
machine)."""
ABUSE_SAMPLES = 400
"""Healthy cycles taken under the abuse, and in the quiet interludes between its waves, at
least: waves repeat until both counts are reached (the p99 of fewer would be close to a
maximum)."""
ABUSE_MAX_S = 90.0
SPAN_CYCLES = 25


def waves_of(phases: Phases, minimum: int) -> Iterator[int]:
    """Wave numbers: at least ``minimum``, and more until ``ABUSE_SAMPLES`` healthy cycles
    ran under the waves and as many in the quiet interludes between them. Waves run back to
    back in spans of ``SPAN_CYCLES`` healthy cycles, each span right after an interlude."""
    deadline = time.monotonic() + ABUSE_MAX_S

    def enough(n: int) -> bool:
        return (
            n >= minimum
            and phases.abuse_count() >= ABUSE_SAMPLES
            and phases.quiet_count() >= ABUSE_SAMPLES
        )

    n = 0
    while not enough(n):
        assert time.monotonic() < deadline, f"healthy client starved: {phases.abuse_count()}"
        phases.quiet_interlude()
        with phases.abuse():
            span_end = phases.abuse_count() + SPAN_CYCLES
            while not enough(n) and phases.abuse_count() < span_end:
                yield n
                n += 1


def _send(sock: socket.socket, data: bytes) -> bool:
    """Send; False when the server had already hung up."""
    try:
        sock.sendall(data)
    except OSError as exc:
        if exc.errno not in HUNG_UP:
            raise
        return False
    return True


def _close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()
    socks.clear()


# ---------------------------------------------------------------------- slowloris
SLOWLORIS_READ_TIMEOUT_S = 1.5
DRIP_INTERVAL_S = 0.1


@dataclasses.dataclass
class SlowlorisOutcome:
    held: int  # connections the server still had after the drip
    drip_s: float  # how long the drippers dripped
    dropped: int  # drippers the server closed once they fell silent
    recovery_s: float  # from the last byte until the last dripper was closed


def _slowloris(address: tuple[str, int], attackers_n: int, rounds: int) -> SlowlorisOutcome:
    pace = threading.Event()  # never set: its wait() paces the drip
    partial = b"l\nslowloris-" + b"x" * rounds  # never finished
    attackers = [connect(address) for _ in range(attackers_n)]
    try:
        connected = time.monotonic()
        # 1. A whole request, one byte per connection per round: all answered.
        for byte in PING:
            for sock in attackers:
                sock.sendall(bytes([byte]))
            pace.wait(DRIP_INTERVAL_S)
        replies = [recv_line(sock) for sock in attackers]
        assert replies == [b"ok"] * attackers_n
        # 2. A request that never ends, dripped for longer in all than the read timeout.
        for byte in partial[:rounds]:
            for sock in attackers:
                sock.sendall(bytes([byte]))
            pace.wait(DRIP_INTERVAL_S)
        last_byte = time.monotonic()
        held = server_stats(address)["connections"] - 2  # the healthy client, the asker
        # 3. Silence, mid-request: the read timeout drops them all.
        deadline = last_byte + SLOWLORIS_READ_TIMEOUT_S + DROP_SLACK_S
        dropped = sum(closed_by_peer(sock, deadline - time.monotonic()) for sock in attackers)
        return SlowlorisOutcome(held, last_byte - connected, dropped, time.monotonic() - last_byte)
    finally:
        _close_all(attackers)


def test_slowloris(fault_report: FaultReport) -> None:
    """Hundreds of connections drip requests a byte at a time. Each byte resets the idle
    clock (PROTOCOL.md: the read timeout is an idle timeout), so the drippers keep their
    connections while they drip, and their requests, once whole, are answered. The healthy
    client is served throughout; once the drippers fall silent mid-request, the read timeout
    drops every one of them."""
    attackers_n = scaled(300, 1000)
    rounds = scaled(10, 40)
    raise_fd_limit(2 * attackers_n + 256)
    with (
        dflockd("--read-timeout", str(SLOWLORIS_READ_TIMEOUT_S)) as server,
        HealthyClient(server.address, key="slowloris-healthy") as healthy,
    ):
        address = server.address
        phases = Phases(healthy)
        baseline = server.rss_kib()
        phases.quiet(QUIET_SAMPLES)  # just before
        with RssWatch(server.pid) as rss, phases.abuse():
            out = run_abuser(lambda: _slowloris(address, attackers_n, rounds))
        phases.quiet(QUIET_SAMPLES)  # and just after
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        assert out.held == attackers_n, f"{attackers_n - out.held} dropped while dripping"
        assert out.drip_s > SLOWLORIS_READ_TIMEOUT_S
        assert out.dropped == attackers_n, f"{attackers_n - out.dropped} silent drippers kept"
        wait_for_connections(address, 1)
        judge_abuse(
            fault_report,
            f"slowloris: {attackers_n} connections, a byte each every {DRIP_INTERVAL_S} s",
            runs=1,
            operations=attackers_n + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, attackers_n),
            recovery_s=out.recovery_s,
            p99_floor_ms=0.0,  # acceptance 3 names slowloris: 10x the quiet p99, no floor
            details=(
                f"all {attackers_n} dripped pings answered; all kept through "
                f"{out.drip_s:.1f} s of dripping (read timeout {SLOWLORIS_READ_TIMEOUT_S:g} s); "
                f"silent mid-request, all dropped {out.recovery_s:.1f} s after their last byte"
            ),
        )


# ---------------------------------------------------------------------- connection floods
def _flood_wave(
    address: tuple[str, int], count: int, source_ip: str | None = None
) -> tuple[list[socket.socket], int, int]:
    """Open ``count`` connections and ping on each: (sockets, answered, closed unanswered)."""
    socks = [connect(address, source_ip) for _ in range(count)]
    for sock in socks:
        _send(sock, PING)
    replies = [recv_line(sock) for sock in socks]
    unexpected = [r for r in replies if r not in (b"ok", b"")]
    assert not unexpected, unexpected[:5]
    return socks, replies.count(b"ok"), replies.count(b"")


def test_connection_flood_past_max_connections(fault_report: FaultReport) -> None:
    """Waves of connections, four times ``--max-connections`` each: the connections past the
    cap are accepted and closed at once without a byte, the ones under it are served, the
    healthy client (connected before) and a lock holder keep working, and once a wave is
    gone a newcomer gets in."""
    cap = scaled(50, 200)
    wave = 4 * cap
    min_waves = scaled(5, 25)
    existing = 2  # the healthy client and the holder
    raise_fd_limit(2 * wave + 256)
    with (
        dflockd("--max-connections", str(cap)) as server,
        HealthyClient(server.address, key="flood-healthy") as healthy,
        open_wire(server.address) as holder,
    ):
        address = server.address
        token = holder.lock("flood-victim", lease=60)
        phases = Phases(healthy)
        baseline = server.rss_kib()
        admitted_counts: list[int] = []
        recoveries: list[float] = []

        def flood() -> None:
            for _ in waves_of(phases, min_waves):
                socks, admitted, refused = _flood_wave(address, wave)
                admitted_counts.append(admitted)
                assert admitted + refused == wave
                assert holder.req("n", "flood-victim", f"{token} 60") == "ok 60"
                _close_all(socks)
                recoveries.append(wait_for_connections(address, existing))
                with open_wire(address) as newcomer:
                    assert newcomer.req("ping") == "ok"

        with RssWatch(server.pid) as rss:
            run_abuser(flood)
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        waves = len(admitted_counts)
        # The asker of the previous wave's check may still be counted: one slot of slack.
        assert all(cap - existing - 1 <= n <= cap - existing for n in admitted_counts), (
            admitted_counts
        )
        judge_abuse(
            fault_report,
            f"connection flood: waves of {wave} past --max-connections {cap}",
            runs=waves,
            operations=waves * wave + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, cap),
            recovery_s=max(recoveries),
            details=(
                f"{waves * wave} connections: {sum(admitted_counts)} served (never more than "
                f"the cap), the rest closed without a byte; lock holder renewed after each "
                f"wave; a newcomer got in after each"
            ),
        )


def test_connection_flood_past_max_connections_per_ip(fault_report: FaultReport) -> None:
    """Waves from one address (127.0.0.2) past ``--max-connections-per-ip``: exactly the cap
    is served; a client from another address (127.0.0.3) gets in meanwhile; the healthy
    client (127.0.0.1) keeps working."""
    per_ip = scaled(20, 100)
    wave = 5 * per_ip
    min_waves = scaled(10, 40)
    raise_fd_limit(2 * wave + 256)
    with (
        dflockd("--max-connections-per-ip", str(per_ip)) as server,
        HealthyClient(server.address, key="per-ip-healthy") as healthy,
    ):
        address = server.address
        phases = Phases(healthy)
        baseline = server.rss_kib()
        admitted_counts: list[int] = []

        def flood() -> None:
            for _ in waves_of(phases, min_waves):
                socks, admitted, refused = _flood_wave(address, wave, "127.0.0.2")
                admitted_counts.append(admitted)
                assert admitted + refused == wave
                with connect(address, "127.0.0.3") as other:
                    other.sendall(PING)
                    assert recv_line(other) == b"ok"
                _close_all(socks)
                wait_for_connections(address, 1)

        with RssWatch(server.pid) as rss:
            run_abuser(flood)
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        waves = len(admitted_counts)
        assert admitted_counts == [per_ip] * waves
        judge_abuse(
            fault_report,
            f"connection flood from one address past --max-connections-per-ip {per_ip}",
            runs=waves,
            operations=waves * wave + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, per_ip),
            details=(
                f"{waves * wave} connections from 127.0.0.2: exactly {per_ip} served per wave, "
                "the rest closed without a byte; 127.0.0.3 served during every wave"
            ),
        )


# ---------------------------------------------------------------------- waiters
CLOSE_BURST = 50
"""Waiter and extra connections closed at once at the end of a round (see ``LINE_BURST``)."""


def wait_for_waiters(address: tuple[str, int], key: str, count: int) -> None:
    """Until the server shows exactly ``count`` waiters on ``key``."""

    def waiters() -> int:
        for entry in server_stats(address)["locks"]:
            if entry["key"] == key:
                return int(entry["waiters"])
        return 0

    wait_until(lambda: waiters() == count, timeout=10.0, what=f"{count} waiters on {key}")


def _next_granted(
    waiters: list[socket.socket], expected: socket.socket, timeout: float
) -> tuple[bytes, int]:
    """Wait for a grant among ``waiters``: (the grant, how many others became readable)."""
    with selectors.DefaultSelector() as sel:
        for sock in waiters:
            sel.register(sock, selectors.EVENT_READ)
        ready = [key.fileobj for key, _ in sel.select(timeout)]
    assert ready, f"no waiter granted within {timeout} s"
    assert expected in ready, "a waiter was granted out of FIFO order"
    return recv_line(expected), len(ready) - 1


@dataclasses.dataclass
class WaitersTally:
    rounds: int = 0
    refused: int = 0  # acquires answered error_max_waiters
    grants: int = 0
    double_grants: int = 0  # another waiter readable while one holds the lock


def _waiters_round(
    address: tuple[str, int],
    holder: Wire,
    max_waiters: int,
    extra_connections: int,
    extra_each: int,
    tally: WaitersTally,
) -> None:
    """Fill the queue of ``hot``, refuse the extras, then drain the queue in FIFO order."""
    refusal = c.STATUS_ERROR_MAX_WAITERS.encode()
    token = holder.lock("hot", lease=60)
    waiters = [connect(address) for _ in range(max_waiters)]
    extras = [connect(address) for _ in range(extra_connections)]
    try:
        for i, sock in enumerate(waiters):
            sock.sendall(b"l\nhot\n60\n")
            wait_for_waiters(address, "hot", i + 1)  # queued in this order
        acquires = (b"l\nhot\n60\n", b"e\nhot\n_\n")  # blocking, two-phase
        pipelined = b"".join(acquires[j % 2] for j in range(extra_each))
        for sock in extras:
            sock.sendall(pipelined + PING)
        for sock in extras:
            replies = [recv_line(sock) for _ in range(extra_each + 1)]
            assert replies == [refusal] * extra_each + [b"ok"], replies
            tally.refused += extra_each
        wait_for_waiters(address, "hot", max_waiters)  # none sneaked in
        assert holder.req("r", "hot", token) == "ok"
        last_fence = fence_of(token)
        queue = list(waiters)
        for sock in waiters:
            grant, others = _next_granted(queue, sock, 10.0)
            tally.double_grants += others
            status, granted, _ = grant.decode().split()
            assert status == "ok" and fence_of(granted) > last_fence
            last_fence = fence_of(granted)
            tally.grants += 1
            queue.remove(sock)
            sock.sendall(f"r\nhot\n{granted}\n".encode())
            assert recv_line(sock) == b"ok"
    finally:
        # In bursts, each seen through by the server before the next: the server's work for
        # these closes belongs to this abuse span, not to the quiet interlude after it, and
        # a mass disconnect is the connection floods' abuse, not this one's.
        socks = waiters + extras
        for end in range(CLOSE_BURST, len(socks) + CLOSE_BURST, CLOSE_BURST):
            _close_all(socks[end - CLOSE_BURST : end])
            wait_for_connections(address, 2 + max(0, len(socks) - end))
    tally.rounds += 1


def test_waiters_past_max_waiters(fault_report: FaultReport) -> None:
    """A key's queue filled to ``--max-waiters``; many more acquires (``l`` and ``e``) from
    other connections get ``error_max_waiters`` at once and keep their connections; then the
    queued ones are granted one at a time in FIFO order with increasing fences."""
    max_waiters = scaled(20, 100)
    extra_connections = scaled(25, 100)
    extra_each = scaled(10, 20)
    min_rounds = scaled(4, 15)
    raise_fd_limit(max_waiters + extra_connections + 256)
    with (
        dflockd("--max-waiters", str(max_waiters)) as server,
        HealthyClient(server.address, key="waiters-healthy") as healthy,
        open_wire(server.address) as holder,
    ):
        address = server.address
        phases = Phases(healthy)
        baseline = server.rss_kib()
        tally = WaitersTally()

        def abuse() -> None:
            for _ in waves_of(phases, min_rounds):
                _waiters_round(address, holder, max_waiters, extra_connections, extra_each, tally)

        with RssWatch(server.pid) as rss:
            run_abuser(abuse)
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        assert tally.grants == tally.rounds * max_waiters and tally.double_grants == 0
        wait_for_connections(address, 2)
        judge_abuse(
            fault_report,
            f"waiters past --max-waiters {max_waiters}",
            runs=tally.rounds,
            operations=tally.refused + 2 * tally.grants + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, max_waiters + extra_connections),
            double_grants=tally.double_grants,
            details=(
                f"{tally.refused} acquires past the cap got error_max_waiters and kept their "
                f"connections; {tally.grants} queued waiters granted one at a time in FIFO "
                "order, fences increasing"
            ),
        )


# ---------------------------------------------------------------------- over-long lines
MEBIBYTE = 1 << 20
LONG_LINE = c.MAX_AUTH_LINE_BYTES + 4096
"""An over-long line: past even the ``auth`` line's limit, 272 times the others'."""
LINE_BURST = 50
"""Connections that send their over-long line at the same moment. The long run sends more
bursts, not bigger ones: connections that are all ready at once are served in one pass of
the event loop, 40-60 us each here, and the healthy client waits for the pass. Measured on
this 2-core machine, healthy p99 under bursts of 100: 4-12 ms; of 200: 5-18 ms, at or past
the 10 ms bound with the machine's other load."""


def _push(socks: list[tuple[socket.socket, bytes]], timeout: float) -> int:
    """Send every payload at once (non-blocking) until it is all out or the server has cut
    the connection; the bytes the kernel took."""
    pushed = 0
    deadline = time.monotonic() + timeout
    offsets: dict[socket.socket, int] = {}
    with selectors.DefaultSelector() as sel:
        for sock, payload in socks:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_WRITE, payload)
            offsets[sock] = 0
        while sel.get_map():
            assert time.monotonic() < deadline, "over-long lines still being sent"
            for key, _ in sel.select(0.5):
                sock, payload = key.fileobj, key.data
                assert isinstance(sock, socket.socket) and isinstance(payload, bytes)
                try:
                    sent = sock.send(payload[offsets[sock] : offsets[sock] + 65536])
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno not in HUNG_UP:
                        raise
                    sel.unregister(sock)
                    continue
                pushed += sent
                offsets[sock] += sent
                if offsets[sock] >= len(payload):
                    sel.unregister(sock)
    for sock, _ in socks:
        sock.setblocking(True)
    return pushed


@dataclasses.dataclass
class LinesTally:
    waves: int = 0
    offered: int = 0  # bytes the attackers tried to send
    pushed: int = 0  # bytes the kernel took from them
    errors: int = 0  # attackers that read the error reply before the close


def _long_lines_wave(
    address: tuple[str, int], payloads: list[bytes], attackers_n: int, tally: LinesTally
) -> None:
    socks = [connect(address) for _ in range(attackers_n)]
    try:
        work = [(sock, payloads[i % len(payloads)]) for i, sock in enumerate(socks)]
        tally.offered += sum(len(p) for _, p in work)
        tally.pushed += _push(work, 60.0)
        for i, sock in enumerate(socks):
            data, closed = read_until_closed(sock, 10.0)
            assert closed, "an over-long line did not close its connection"
            expected = b"ok\nerror\n" if i % len(payloads) == 1 else b"error\n"
            assert data in (expected, expected[: -len(b"error\n")], b""), data
            tally.errors += data.endswith(b"error\n")
    finally:
        _close_all(socks)
    tally.waves += 1


def test_flood_of_over_long_lines(fault_report: FaultReport) -> None:
    """Waves of connections, all at once, each sending a line far past its limit: a command
    line before auth, a key line after auth, or an ``auth`` line past 64 KiB. Each gets
    ``error`` (or a reset, when the server's close overtakes the reply) and is closed; the
    server reads no more than one buffer of each, so its memory does not follow the hundreds
    of megabytes offered; the healthy client (authenticated) and a lock holder are served."""
    attackers_n = LINE_BURST
    min_waves = scaled(6, 200)
    raise_fd_limit(2 * attackers_n + 256)
    auth = f"auth\n_\n{SECRET}\n".encode()
    payloads = [
        b"x" * LONG_LINE,  # command line, before auth
        auth + b"l\n" + b"k" * LONG_LINE,  # key line, after auth
        b"auth\n_\n" + b"s" * LONG_LINE,  # auth line
    ]
    with (
        dflockd("--auth-token", SECRET) as server,
        HealthyClient(server.address, key="lines-healthy", secret=SECRET) as healthy,
        open_wire(server.address, SECRET) as holder,
    ):
        address = server.address
        token = holder.lock("lines-victim", lease=60)
        phases = Phases(healthy)
        baseline = server.rss_kib()
        tally = LinesTally()

        def abuse() -> None:
            for _ in waves_of(phases, min_waves):
                _long_lines_wave(address, payloads, attackers_n, tally)
                assert holder.req("n", "lines-victim", f"{token} 60") == "ok 60"

        with RssWatch(server.pid) as rss:
            run_abuser(abuse)
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        wait_for_connections(address, 2, secret=SECRET)
        judge_abuse(
            fault_report,
            f"over-long lines: waves of {attackers_n} connections at once",
            runs=tally.waves,
            operations=tally.waves * attackers_n + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, attackers_n),
            details=(
                f"{tally.waves * attackers_n} lines past the limit "
                f"({tally.offered / MEBIBYTE:.0f} MiB offered, "
                f"{tally.pushed / MEBIBYTE:.0f} MiB taken by the kernel): all closed, "
                f"{tally.errors} with the error reply before the close; lock holder renewed"
            ),
        )


# ---------------------------------------------------------------------- auth brute force
BRUTE_PER_IP_CAP = 8
WRONG_GUESS = re.compile(r"connection 127\.0\.0\.2:\d+: wrong auth secret")


def _guess(address: tuple[str, int], source_ip: str, secret: str) -> tuple[bytes, float, bool]:
    """One patient guess: (the reply, seconds until it came, closed after it)."""
    with connect(address, source_ip) as sock:
        start = time.monotonic()
        sock.sendall(f"auth\n_\n{secret}\n".encode())
        reply = recv_line(sock)
        took = time.monotonic() - start
        return reply, took, closed_by_peer(sock, 5.0)


@dataclasses.dataclass
class BruteTally:
    patient: list[tuple[bytes, float, bool]] = dataclasses.field(default_factory=list)
    patient_s: float = 0.0  # until every patient guess was answered
    right_s: float = 0.0  # the right secret's auth + lock, meanwhile
    impatient_attempts: int = 0


def _brute_force(
    address: tuple[str, int], guessers: int, impatient_s: float, tally: BruteTally
) -> None:
    # Patient guessers, one address each, all at once.
    def guess(i: int) -> None:
        tally.patient.append(_guess(address, f"127.0.1.{i + 1}", f"guess-{i}"))

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(guessers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    right_started = time.monotonic()
    with open_wire(address, SECRET) as right:  # meanwhile
        assert right.lock("brute-k")
        tally.right_s = time.monotonic() - right_started
    for thread in threads:
        thread.join(30)
    tally.patient_s = time.monotonic() - started
    # Pipelined guesses: one answer; the right secret behind them is never evaluated.
    with connect(address, "127.0.0.4") as sock:
        sock.sendall(
            b"".join(f"auth\n_\nguess-{i}\n".encode() for i in range(5))
            + f"auth\n_\n{SECRET}\n".encode()
            + PING
        )
        assert read_until_closed(sock, 10.0) == (b"error_auth\n", True)
    # An impatient guesser on one address: send, look for "ok" briefly, hang up.
    end = time.monotonic() + impatient_s
    while time.monotonic() < end:
        with connect(address, "127.0.0.2") as sock:
            if _send(sock, f"auth\n_\nimpatient-{tally.impatient_attempts}\n".encode()):
                sock.settimeout(0.002)
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    assert sock.recv(16) in (b"", b"error_auth\n")
        tally.impatient_attempts += 1


def test_auth_brute_force(fault_report: FaultReport) -> None:
    """Wrong secrets, concurrently from many addresses: each is answered ``error_auth`` after
    the failure delay and closed, in parallel (the delay holds no one else up); several
    guesses pipelined on one connection get one answer; the right secret works meanwhile.
    An impatient guesser that hangs up instead of waiting for the answer still pays the
    delay: each wrong guess keeps its connection slot for it, so with
    ``--max-connections-per-ip`` one address gets at most cap / delay guesses a second."""
    guessers = scaled(40, 200)
    impatient_s = float(scaled(2, 8))
    delay = c.AUTH_FAILURE_DELAY_S
    with (
        dflockd(
            "--auth-token",
            SECRET,
            "--max-connections-per-ip",
            str(BRUTE_PER_IP_CAP),
            "--log-level",
            "debug",
        ) as server,
        HealthyClient(server.address, key="brute-healthy", secret=SECRET) as healthy,
    ):
        address = server.address
        phases = Phases(healthy)
        baseline = server.rss_kib()
        tally = BruteTally()
        phases.quiet(QUIET_SAMPLES)  # just before
        with RssWatch(server.pid) as rss, phases.abuse():
            run_abuser(lambda: _brute_force(address, guessers, impatient_s, tally))
        phases.quiet(QUIET_SAMPLES)  # and just after
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        wait_for_connections(address, 1, secret=SECRET)
        evaluated = sum(bool(WRONG_GUESS.search(line)) for line in server.drain_log())
        assert len(tally.patient) == guessers
        assert all(reply == b"error_auth" and closed for reply, _, closed in tally.patient)
        took = sorted(t for _, t, _ in tally.patient)
        assert took[0] >= delay * 0.9, f"a wrong guess was answered after {took[0]:.3f} s"
        assert tally.patient_s < delay + DROP_SLACK_S, f"{guessers} guesses: {tally.patient_s} s"
        assert tally.right_s < delay, f"the right secret waited {tally.right_s:.2f} s"
        most = BRUTE_PER_IP_CAP * (impatient_s / delay + 1)
        assert evaluated <= most, (
            f"{evaluated} of {tally.impatient_attempts} impatient guesses evaluated in "
            f"{impatient_s:.0f} s from one address; at most {most:.0f} should be"
        )
        judge_abuse(
            fault_report,
            "auth brute force: wrong secrets",
            runs=2,
            operations=guessers + tally.impatient_attempts + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, guessers),
            details=(
                f"{guessers} concurrent wrong guesses: all error_auth then closed, answered "
                f"after {took[0]:.2f}-{took[-1]:.2f} s (delay {delay} s), "
                f"{tally.patient_s:.1f} s for all; right secret served meanwhile; pipelined "
                f"guesses got one answer; an impatient guesser hanging up made "
                f"{tally.impatient_attempts} attempts in {impatient_s:.0f} s from one address, "
                f"{evaluated} evaluated (per-IP cap {BRUTE_PER_IP_CAP})"
            ),
        )


# ---------------------------------------------------------------------- TLS
TLS_READ_TIMEOUT_S = 1.0
TLS_WAVE_P99_FLOOR_MS = 4.0
"""The quiet p99 floor of the stalled-handshake waves, on both event loops. Each connection of
a wave of 1,000 costs the loop a transport, a protocol and a TLS object, made in a few large
turns of the accept, and the read timeout closes the stalled ones in a few more; a healthy
request that lands behind such a turn waits for it. How long a turn takes depends on the
machine more than on the loop:
- asyncio's loop, 2026-11-30, alone on stop 89's 2-core machine, on this server and on
  dcdbaf9's alike: a p99 under the waves of 10.4 to 21.8 ms over 12 runs (quiet p99 0.75 to
  1.4 ms, so 10x of a quiet p99 floored at 1 ms failed 8 of the 12); 27.1 ms in one CI run
  (quiet p99 2.09 ms);
- uvloop, in that machine's CI (the same day): 10.33 ms under the waves, turns of 10 to 29 ms
  among them, against a quiet p99 of 0.86 ms, so it failed the 1 ms floor's 10 ms bound too;
- both loops on the next session's machine, alone, 2026-11-30: 0.7 to 1.8 ms under the waves,
  and 0.85 to 1.6 ms with a process spinning on one of the two cores.
Floored at 4 ms, the bound is 40 ms: above the longest turn seen (29 ms)."""


@dataclasses.dataclass
class TlsTally:
    rounds: int = 0
    refused: int = 0  # bad clients turned away
    stalled_dropped: int = 0
    stall_recovery_s: float = 0.0  # until the last stalled handshake was dropped


def _bad_tls_round(
    address: tuple[str, int],
    good: ssl.SSLContext,
    wrong_ca: ssl.SSLContext,
    per_kind: int,
    tally: TlsTally,
) -> None:
    for _ in range(per_kind):
        with pytest.raises(ssl.SSLCertVerificationError):  # trusts another certificate
            open_wire(address, ssl_context=wrong_ca)
        with connect(address) as raw, pytest.raises(ssl.SSLCertVerificationError):
            good.wrap_socket(raw, server_hostname="localhost")  # expects another name
        for junk in (PING, bytes(range(256)) * 4):  # plain text, garbage
            with connect(address) as sock:
                _send(sock, junk)
                data, closed = read_until_closed(sock, 10.0)
                assert closed and b"ok" not in data, data[:80]
        tally.refused += 4
    with open_wire(address, ssl_context=good) as fresh:
        assert fresh.req("ping") == "ok"
    tally.rounds += 1


def _stalled_handshakes(address: tuple[str, int], count: int, tally: TlsTally) -> None:
    """Connections that never start, or never finish, their handshake."""
    stalled = [connect(address) for _ in range(count)]
    try:
        for sock in stalled[: count // 2]:
            sock.sendall(b"\x16\x03\x01\x00")  # the first bytes of a ClientHello
        started = time.monotonic()
        deadline = started + TLS_READ_TIMEOUT_S + DROP_SLACK_S
        tally.stalled_dropped = sum(
            closed_by_peer(sock, deadline - time.monotonic()) for sock in stalled
        )
        tally.stall_recovery_s = time.monotonic() - started
    finally:
        _close_all(stalled)


def test_tls_wrong_certificate(fault_report: FaultReport, tmp_path: Path) -> None:
    """Against a TLS server: clients that trust another certificate, or expect another
    name, fail their handshake; plain-text and garbage clients are dropped without a reply;
    connections that never finish the handshake are dropped after the read timeout; the
    healthy TLS client and a fresh good one are served throughout."""
    server_cert = make_certificate(tmp_path, "server")
    other_cert = make_certificate(tmp_path, "other")
    per_kind = scaled(15, 60)
    min_rounds = scaled(2, 10)
    stalled_n = scaled(100, 400)
    raise_fd_limit(2 * stalled_n + 256)
    good = client_context(server_cert)
    wrong_ca = client_context(other_cert)
    with (
        dflockd(
            "--tls-cert",
            str(server_cert),
            "--tls-key",
            str(key_of(server_cert)),
            "--read-timeout",
            str(TLS_READ_TIMEOUT_S),
        ) as server,
        HealthyClient(server.address, key="tls-healthy", cafile=server_cert) as healthy,
    ):
        address = server.address
        phases = Phases(healthy)
        baseline = server.rss_kib()
        tally = TlsTally()

        def abuse() -> None:
            for _ in waves_of(phases, min_rounds):
                _bad_tls_round(address, good, wrong_ca, per_kind, tally)
            with phases.abuse():
                _stalled_handshakes(address, stalled_n, tally)
            phases.quiet(QUIET_SAMPLES)  # just after

        with RssWatch(server.pid) as rss:
            run_abuser(abuse)
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        assert tally.stalled_dropped == stalled_n, (
            f"{stalled_n - tally.stalled_dropped} stalled handshakes kept"
        )
        wait_for_connections(address, 1, ssl_context=good)
        tls_bound = baseline + stalled_n * TLS_HANDSHAKE_RSS_BUDGET_KIB + RSS_SLACK_KIB
        judge_abuse(
            fault_report,
            "TLS: wrong certificate, wrong name, plain text, garbage, stalled handshakes",
            runs=tally.rounds,
            operations=tally.refused + stalled_n + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=tls_bound,
            after_bound_kib=tls_bound,  # the allocator may keep what the handshakes used
            recovery_s=tally.stall_recovery_s,
            details=(
                f"{tally.refused} bad clients refused (certificate from another CA or for "
                "another name: handshake failed; plain text and garbage: closed without a "
                f"reply); {stalled_n} stalled handshakes dropped after "
                f"{tally.stall_recovery_s:.1f} s (read timeout {TLS_READ_TIMEOUT_S:g} s)"
            ),
        )


def _handshake_cap_bound_kib(baseline_kib: int) -> int:
    """What stalled handshakes may cost the server at most, however many waves come: at most
    ``--max-tls-handshakes`` are under way at once, each within its budget, plus what the
    allocator keeps. It is a high-water mark, not a growth: under load, later waves can find
    more handshakes in flight than the first did, and the allocator keeps that peak (10 waves
    of 1,000 beside two other test suites rose from 34-38 MiB after the first wave to a plateau
    of 44-54 MiB by the sixth, flat after it). The loop's own TLS broke this bound within three
    waves (about 45 MiB a wave on uvloop; about 1 GiB on asyncio's loop over four waves)."""
    return (
        baseline_kib + c.DEFAULT_MAX_TLS_HANDSHAKES * TLS_HANDSHAKE_RSS_BUDGET_KIB + RSS_SLACK_KIB
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_waves_of_stalled_tls_handshakes(
    fault_report: FaultReport, tmp_path: Path, loop: str
) -> None:
    """Waves of connections that never finish their TLS handshake, on each event loop: they
    are all dropped (the oldest as soon as ``--max-tls-handshakes`` are under way, the rest
    at the read timeout), the server's memory never passes what that many handshakes may cost
    (``_handshake_cap_bound_kib``: the loop's own TLS kept about 45 MiB a wave on uvloop, and
    grew to about 1 GiB on asyncio's loop), and the healthy TLS client's p99 stays within its
    bound."""
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is optional and not installed here")
    cert = make_certificate(tmp_path, "server")
    waves, per_wave = scaled(3, 9), scaled(1000, 3000)
    raise_fd_limit(per_wave + 512)
    with (
        dflockd(
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key_of(cert)),
            "--read-timeout",
            str(TLS_READ_TIMEOUT_S),
            "--event-loop",
            loop,
        ) as server,
        HealthyClient(server.address, key="tls-waves", cafile=cert) as healthy,
    ):
        address = server.address
        phases = Phases(healthy)
        baseline = server.rss_kib()
        after_wave: list[int] = []
        dropped: list[int] = []
        tally = TlsTally()

        def abuse() -> None:
            for _ in range(waves):
                phases.quiet_interlude()
                with phases.abuse():
                    _stalled_handshakes(address, per_wave, tally)
                dropped.append(tally.stalled_dropped)
                after_wave.append(server.rss_kib())
            phases.quiet(QUIET_SAMPLES)

        with RssWatch(server.pid) as rss:
            run_abuser(abuse)
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        assert dropped == [per_wave] * waves, f"stalled handshakes kept: dropped {dropped}"
        wait_for_connections(address, 1, ssl_context=client_context(cert))
        growth = after_wave[-1] - after_wave[0]
        cap_bound = _handshake_cap_bound_kib(baseline)
        judge_abuse(
            fault_report,
            f"TLS ({loop}): {waves} waves of {per_wave:,} stalled handshakes",
            runs=waves,
            operations=sum(dropped) + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=cap_bound,
            after_bound_kib=cap_bound,
            recovery_s=tally.stall_recovery_s,
            p99_floor_ms=TLS_WAVE_P99_FLOOR_MS,
            details=(
                f"all {sum(dropped):,} dropped (at most {c.DEFAULT_MAX_TLS_HANDSHAKES} "
                f"handshakes under way, the oldest dropped past it; the rest after the "
                f"{TLS_READ_TIMEOUT_S:g} s read timeout); server RSS after each wave "
                f"{', '.join(f'{kib / KIB:.1f}' for kib in after_wave)} MiB: "
                f"{growth / KIB:+.1f} MiB from the first to the last; bound: at most "
                f"{c.DEFAULT_MAX_TLS_HANDSHAKES} handshakes x {TLS_HANDSHAKE_RSS_BUDGET_KIB} "
                f"KiB over the baseline"
            ),
        )


# ---------------------------------------------------------------------- stats flood
STATS_REQUEST = b"stats\n_\n_\n"
MIB = KIB * KIB
STATS_REPLY_BUDGET_KIB = 256
"""What one flooding connection's unsent stats replies may cost the server while it reads
them: a reply of about 90 KiB (1,008 keys) beyond the 64 KiB write threshold."""


def _stats_wave(socks: list[socket.socket], per_conn: int) -> int:
    """Each connection pipelines ``per_conn`` stats; all replies are read at once (a
    selector). The bytes received."""
    for sock in socks:
        sock.sendall(STATS_REQUEST * per_conn)
    left = {sock.fileno(): per_conn for sock in socks}
    received = 0
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + ABUSE_MAX_S
        while left:
            assert time.monotonic() < deadline, f"stats unanswered on {len(left)} connections"
            for key, _ in selector.select(timeout=1.0):
                sock = cast(socket.socket, key.fileobj)
                chunk = sock.recv(1 << 20)
                assert chunk, "the server closed a reading stats client"
                received += len(chunk)
                fd = sock.fileno()
                left[fd] -= chunk.count(b"\n")
                if left[fd] <= 0:
                    del left[fd]
                    selector.unregister(sock)
    return received


STATS_FLOOD_P99_FLOOR_MS = 2.0
"""The quiet p99 floor of the stats flood: a healthy request that comes while the server
builds a snapshot of the full table (1,008 keys, 166 KiB) waits for the whole build, and the
rationing (a tenth of the server's time) puts about one request in ten behind one, so the p99
under the flood is one build's time. Measured on 2026-11-29, alone on this 2-core machine: 8.7
to 11.6 ms, with the server of 8e2806d and with this one alike (10x of a quiet p99 floored at
1 ms failed 6 of 8 runs of both). Floored at 2 ms, the bound (20 ms) is two builds: a request
never waits behind a second one."""


def test_stats_flood_over_a_full_table(fault_report: FaultReport) -> None:
    """Connections that pipeline ``stats`` over a table of 1,000 held keys (the default
    --max-locks is 1,024) and read every reply: each is answered, the server rations its
    snapshots (every stats asked while one is due shares it), so the healthy client's p99
    stays within its bound (the issue measured a p50 of 557 ms under 200 such connections
    before), and the holders keep renewing."""
    flooders = scaled(50, 200)
    per_conn = scaled(5, 20)
    holders_n, per_holder = 16, 63  # within the per-connection cap of held keys
    raise_fd_limit(flooders + holders_n + 256)
    with (
        # The table is filled from one address: past the per-address share (3/4 of the
        # table by default, issue 47's fair default) on purpose.
        dflockd("--max-locks-per-ip", "0") as server,
        HealthyClient(server.address, key="stats-healthy") as healthy,
    ):
        address = server.address
        holders = [open_wire(address) for _ in range(holders_n)]
        socks: list[socket.socket] = []
        try:
            tokens = [
                [(f"held-{h}-{i}", wire.lock(f"held-{h}-{i}", lease=60)) for i in range(per_holder)]
                for h, wire in enumerate(holders)
            ]
            socks = [connect(address) for _ in range(flooders)]
            phases = Phases(healthy)
            baseline = server.rss_kib()
            received: list[int] = []

            def flood() -> None:
                for _ in waves_of(phases, scaled(2, 5)):
                    received.append(_stats_wave(socks, per_conn))
                    for wire, held in zip(holders, tokens, strict=True):
                        key, token = held[0]
                        assert wire.req("n", key, f"{token} 60") == "ok 60"
                phases.quiet(QUIET_SAMPLES)

            with RssWatch(server.pid) as rss:
                run_abuser(flood)
        finally:
            _close_all(socks)
            for wire in holders:
                wire.close()
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        waves = len(received)
        answered = waves * flooders * per_conn
        reply_kib = sum(received) / answered / KIB
        judge_abuse(
            fault_report,
            f"stats flood: {flooders} connections pipelining stats over 1,008 held keys",
            runs=waves,
            operations=answered + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, flooders) + flooders * STATS_REPLY_BUDGET_KIB,
            after_bound_kib=rss_bound_kib(baseline, flooders),
            p99_floor_ms=STATS_FLOOD_P99_FLOOR_MS,
            details=(
                f"{answered:,} stats answered ({per_conn} pipelined per connection a wave), "
                f"{reply_kib:.0f} KiB each for an {len(STATS_REQUEST)}-byte request "
                f"(x{reply_kib * KIB / len(STATS_REQUEST):,.0f}), "
                f"{sum(received) / MIB:,.0f} MiB sent in all; snapshots rationed to at most a "
                "tenth of the server's time; 16 holders renewed after every wave"
            ),
        )


# ---------------------------------------------------------------------- default caps
def _pipelined(wire: Wire, requests: list[bytes]) -> list[str]:
    """Send ``requests`` in one write and read one reply line each."""
    wire.send_raw(b"".join(requests))
    return [wire.recv() for _ in requests]


FLOOD_P99_FLOOR_MS = 3.0
"""The quiet p99 floor of the default-caps run in the long version, which adds a flood of
4,200 connections opened at once: the server accepts 4,096 and answers a ping on each in a few
turns of its loop, and a healthy request that arrives among them waits behind that work, about
4 us a connection (measured on 2026-11-28: healthy p99 11-21 ms under the flood, with this
server and with the one of 08ca80f, whose long run on 11-23 saw 4.3 ms; the quiet p99 of the
same runs varied 0.4-3.6 ms, so 10x of it, floored at 1 ms, failed half of them). Floored at
3 ms, the bound (30 ms) is what a turn of the whole flood may cost, and no more."""


def test_the_default_caps_bound_one_client(fault_report: FaultReport) -> None:
    """A server with every default: one connection asks for 200 keys (64 granted, the rest
    ``error_max_locks``), one enqueues on 128 busy keys (64 queued, the rest
    ``error_max_waiters``), a lease above 300 s is an ``error``, and a flood of 4,200
    connections finds 4,096 slots; the healthy client keeps its p99, and every refusal leaves
    its connection serving."""
    per_conn = c.DEFAULT_MAX_LOCKS_PER_CONNECTION
    flood = c.DEFAULT_MAX_CONNECTIONS + 104
    raise_fd_limit(2 * flood + 256)
    with (
        dflockd() as server,
        HealthyClient(server.address, key="caps-healthy") as healthy,
        open_wire(server.address) as hoarder,
        open_wire(server.address) as other,
        open_wire(server.address) as queuer,
    ):
        address = server.address
        phases = Phases(healthy)
        baseline = server.rss_kib()
        outcome: dict[str, int] = {}

        def abuse() -> None:
            phases.quiet_interlude()
            with phases.abuse():
                grabs = _pipelined(hoarder, [f"l\nk{i}\n0\n".encode() for i in range(200)])
                outcome["held"] = sum(r.startswith("ok ") for r in grabs)
                outcome["refused_locks"] = grabs.count("error_max_locks")
                assert hoarder.req("ping") == "ok"
                other_grabs = [f"l\nk{i}\n0\n".encode() for i in range(per_conn, 2 * per_conn)]
                assert all(r.startswith("ok ") for r in _pipelined(other, other_grabs))
                queued = _pipelined(queuer, [f"e\nk{i}\n\n".encode() for i in range(2 * per_conn)])
                outcome["queued"] = queued.count("queued")
                outcome["refused_waits"] = queued.count("error_max_waiters")
                outcome["long_lease"] = int(queuer.req("l", "long", "0 301") == "error")
                assert queuer.req("ping") == "ok"
            for _ in waves_of(phases, 2):  # the hoarder keeps asking past its cap
                more = _pipelined(hoarder, [f"l\nmore{i}\n0\n".encode() for i in range(50)])
                assert all(r == "error_max_locks" for r in more), more[:3]
            if long_run():  # 8,400 sockets: the long run only (CI floods a cap of 50 instead)
                phases.quiet_interlude()
                with phases.abuse():
                    socks, admitted, refused = _flood_wave(address, flood)
                    outcome["admitted"], outcome["refused_conns"] = admitted, refused
                    _close_all(socks)
            phases.quiet(QUIET_SAMPLES)

        with RssWatch(server.pid) as rss:
            run_abuser(abuse)
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
        assert (outcome["held"], outcome["refused_locks"]) == (per_conn, 200 - per_conn), outcome
        assert (outcome["queued"], outcome["refused_waits"]) == (per_conn, per_conn), outcome
        assert outcome["long_lease"] == 1, outcome
        existing = 4  # the healthy client, the hoarder, the other holder and the queuer
        flooded = ""
        if long_run():
            assert outcome["admitted"] == c.DEFAULT_MAX_CONNECTIONS - existing, outcome
            flooded = (
                f"; --max-connections {c.DEFAULT_MAX_CONNECTIONS}: {flood:,} connections, "
                f"{outcome['admitted']:,} served beside the {existing} open, "
                f"{outcome['refused_conns']} closed without a byte"
            )
        judge_abuse(
            fault_report,
            "default caps: one client hoarding keys, waits, leases and connections",
            runs=1,
            operations=200 + 4 * per_conn + 1 + (flood if long_run() else 0) + 2 * len(under),
            quiet=quiet,
            under=under,
            baseline_kib=baseline,
            rss=rss,
            after_kib=server.rss_kib(),
            bound_kib=rss_bound_kib(baseline, c.DEFAULT_MAX_CONNECTIONS),
            after_bound_kib=rss_bound_kib(baseline, c.DEFAULT_MAX_CONNECTIONS),
            p99_floor_ms=FLOOD_P99_FLOOR_MS if long_run() else P99_FLOOR_MS,
            details=(
                f"--max-locks-per-connection {per_conn}: 200 acquires on one connection, "
                f"{outcome['held']} granted, {outcome['refused_locks']} error_max_locks; "
                f"--max-waits-per-connection {c.DEFAULT_MAX_WAITS_PER_CONNECTION}: 128 "
                f"enqueues on busy keys, {outcome['queued']} queued, "
                f"{outcome['refused_waits']} error_max_waiters; a 301 s lease: error "
                f"(--max-lease-ttl {c.DEFAULT_MAX_LEASE_TTL_S}); each connection served on"
                f"{flooded}"
            ),
        )
