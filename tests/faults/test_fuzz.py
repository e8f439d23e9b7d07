"""Protocol fuzzing of the real ``dflockd`` with hypothesis, over real sockets.

One server process stays up across all examples of a module. Each example opens a fresh
connection, sends its bytes (random, or near-valid requests: mutated commands, wrong argument
counts, huge numbers, unicode, CR/LF in odd places, interleaved ``auth``) cut into random
segments, half-closes and reads until the server closes. Every reply line must be a reply the
protocol knows; afterwards the server is still running, answers a ping, and a lock held by
another connection still renews. Meanwhile a healthy client loops acquire + release, and its
p99 must stay below 10x its quiet value (acceptance 3); the server's memory stays bounded and
its log shows no error or unhandled exception.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import socket
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dflockd_server import constants as c
from tests.faults.abuse_helpers import (
    HUNG_UP,
    RssWatch,
    ServerProcess,
    dflockd,
    judge_abuse,
    open_wire,
    read_until_closed,
    rss_bound_kib,
    run_abuser,
    server_stats,
    wait_for_connections,
)
from tests.faults.conftest import FaultReport, scaled
from tests.faults.healthy import INTERLUDE_MIN, MIN_P99_SAMPLES, HealthyClient, Phases
from tests.support.wire import SERVER_COMMANDS, Wire

# The healthy p99 is judged against a starved abuser: CI runs these with the machine to itself.
pytestmark = pytest.mark.alone

ABUSE_SAMPLES = 300
"""Healthy cycles under the fuzzing, at least (the p99 of fewer would be close to a max)."""
MAX_BATCHES = 10
INTERLUDE_EVERY = 20
"""Examples between two quiet interludes (``INTERLUDE_MIN`` healthy cycles each, a third of
the time or so)."""
EXAMPLE_CLOSE_TIMEOUT_S = 5.0
FUZZ_RUN_TIMEOUT_S = 240.0
"""How long one batch of examples may take. An example sent in three pieces or more meets the
server's fragment delay (tens of milliseconds), so the long run's 1,500 examples take 1-2
minutes."""
VICTIM_KEY = "fz-victim"
VICTIM_LEASE_S = 60
HEALTHY_KEY = "fz-healthy"
SECRET = "fuzz-secret-0123456789"
SEND_TIMEOUT_S = 5.0
CONNECTIONS_BESIDES_ABUSE = 3  # healthy client, victim, checker

_STATUSES = "|".join(
    re.escape(s)
    for s in sorted(
        (
            c.STATUS_OK,
            c.STATUS_QUEUED,
            c.STATUS_TIMEOUT,
            c.STATUS_ERROR,
            c.STATUS_ERROR_AUTH,
            c.STATUS_ERROR_MAX_LOCKS,
            c.STATUS_ERROR_MAX_WAITERS,
            c.STATUS_ERROR_LIMIT_MISMATCH,
            c.STATUS_ERROR_NOT_ENQUEUED,
            c.STATUS_ERROR_ALREADY_ENQUEUED,
            c.STATUS_ERROR_LEASE_EXPIRED,
            c.STATUS_ERROR_DRAINING,
        ),
        key=len,
        reverse=True,
    )
)
REPLY_LINE = re.compile(
    rb"(?:(?:ok|acquired) [0-9a-f]{32} [0-9]+"  # grant
    rb"|ok [0-9]+"  # renewed
    rb"|ok \{[^\n]*\}"  # stats
    rb"|timeout [!-~]{1,200}"  # hl refused: the holder's note (MAX_NOTE_BYTES)
    rb"|error_bound [!-~]{1,200}"  # ht refused: the binding run's note
    rb"|(?:" + _STATUSES.encode() + rb"))"
)


# ---------------------------------------------------------------------- strategies
COMMANDS = sorted(name.encode() for name in SERVER_COMMANDS)
NOT_COMMANDS = [b"", b"L", b"ll", b"pingg", b"ok", b"\xc3\xa9", b"\x00", b"stats ", b"l l"]
KEYS = [b"fz0", b"fz1", b"fz2", b"fz-sem", VICTIM_KEY.encode(), b"_"]
ODD_KEYS = [
    b"",
    b" ",
    b"a b",
    b"k\t",
    b"k\rx",
    b"\x00",
    b"\xff\xfe",
    "ключ".encode(),
    "🔒".encode(),
    b"k" * c.MAX_LINE_BYTES,
    b"k" * (c.MAX_LINE_BYTES + 1),
]
NUMBER_WORDS = [
    b"0",
    b"1",
    b"2",
    b"-1",
    b"+1",
    b"1.5",
    b"-0",
    b"0x10",
    b"1e3",
    b"nan",
    "\uff11".encode(),  # a full-width digit one
    str(c.MAX_NUMBER).encode(),
    str(c.MAX_NUMBER + 1).encode(),
    str(c.MAX_SEMAPHORE_LIMIT + 1).encode(),
    str(2**64).encode(),
    b"9" * 300,
]
LINE_ENDS = [b"\n", b"\n", b"\n", b"\n", b"\r\n", b"\r", b"\n\r", b""]
ATOMS = [b"\n", b"\r\n", b"\r", b" ", b"\t", b"_", b"l", b"r", b"n", b"sl", b"fz0", b"1", b"0"]

tokens = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32).map(str.encode)
number_words = st.one_of(
    st.integers(min_value=0, max_value=3).map(lambda n: str(n).encode()),
    st.sampled_from(NUMBER_WORDS),
)
hold_words = [
    b"c",
    b"d",
    b"r",
    b"x",
    b"note-1",
    b"~" * c.MAX_NOTE_BYTES,
    b"~" * (c.MAX_NOTE_BYTES + 1),
]
"""``hl`` modes and ``ht`` ``<onclose>`` ``r`` (and neither), owner notes of every length the
server takes, and one too long (``ht`` / ``hd`` come from ``COMMANDS``)."""
arg_words = st.one_of(
    number_words, tokens, st.sampled_from([b"_", b"", b"\xff"]), st.sampled_from(hold_words)
)
separators = st.sampled_from([b" ", b" ", b"  ", b"\t"])


@st.composite
def arguments(draw: st.DrawFn) -> bytes:
    words = draw(st.lists(arg_words, max_size=4))
    out = b""
    for i, word in enumerate(words):
        out += (draw(separators) if i else b"") + word
    return out


@st.composite
def mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` with one byte-level edit: flip, insert, delete, duplicate or truncate."""
    if not raw:
        return draw(st.binary(max_size=8))
    at = draw(st.integers(min_value=0, max_value=len(raw) - 1))
    edit = draw(st.sampled_from(["flip", "insert", "delete", "duplicate", "truncate"]))
    if edit == "flip":
        return raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1 :]
    if edit == "insert":
        return raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    if edit == "delete":
        return raw[:at] + raw[at + 1 :]
    if edit == "duplicate":
        return raw[: at + 1] + raw[at:]
    return raw[:at]


@st.composite
def near_valid_request(draw: st.DrawFn, secret: bytes | None = None) -> bytes:
    cmd = draw(st.one_of(st.sampled_from(COMMANDS), st.sampled_from(NOT_COMMANDS)))
    key = draw(st.one_of(st.sampled_from(KEYS), st.sampled_from(ODD_KEYS)))
    if cmd == b"auth":
        secrets = [b"wrong", b"", b"x" * 300] + ([secret] if secret is not None else [])
        arg = draw(st.sampled_from(secrets))
    else:
        arg = draw(arguments())
    ends = [draw(st.sampled_from(LINE_ENDS)) for _ in range(3)]
    raw = cmd + ends[0] + key + ends[1] + arg + ends[2]
    if draw(st.integers(min_value=0, max_value=3)) == 0:
        raw = draw(mutated(raw))
    return raw


random_streams = st.one_of(
    st.binary(min_size=1, max_size=600),
    st.lists(st.binary(max_size=24), min_size=3, max_size=15).map(b"\n".join),
    st.lists(st.one_of(st.sampled_from(ATOMS), st.binary(max_size=6)), max_size=80).map(b"".join),
)


def near_valid_streams(secret: bytes | None = None) -> st.SearchStrategy[list[bytes]]:
    return st.lists(near_valid_request(secret), min_size=1, max_size=8)


@st.composite
def cut(draw: st.DrawFn, stream: bytes) -> list[bytes]:
    """``stream`` split at random points (each piece goes out in its own send)."""
    if len(stream) < 2:
        return [stream]
    points = sorted(
        set(draw(st.lists(st.integers(min_value=1, max_value=len(stream) - 1), max_size=6)))
    )
    bounds = [0, *points, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


# ---------------------------------------------------------------------- the target
@dataclasses.dataclass
class Target:
    """A fuzzed server and the bystanders that must not notice."""

    server: ServerProcess
    healthy: HealthyClient
    baseline_rss_kib: int
    victim: Wire
    victim_token: str
    checker: Wire
    secret: str | None = None
    examples: int = 0
    requests: int = 0
    phases: Phases | None = None  # while a fuzz test runs

    def send(self, pieces: list[bytes]) -> tuple[list[bytes], bool]:
        """Send on a fresh connection, half-close, read to the close: (reply lines, closed)."""
        with socket.create_connection(self.server.address, timeout=SEND_TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                for piece in pieces:
                    sock.sendall(piece)
                sock.shutdown(socket.SHUT_WR)
            except OSError as exc:  # the server hung up first (a line over the limit, ...)
                if exc.errno not in HUNG_UP:
                    raise
            data, closed = read_until_closed(sock, EXAMPLE_CLOSE_TIMEOUT_S)
        self.examples += 1
        self.requests += b"".join(pieces).count(b"\n") // 3  # frames, at most
        lines = data.split(b"\n")
        assert lines[-1] == b"", f"reply without its newline: {data[-80:]!r}"
        return lines[:-1], closed

    def check_replies(self, lines: list[bytes], closed: bool) -> None:
        assert closed, "the server kept a half-closed connection open"
        for line in lines:
            assert REPLY_LINE.fullmatch(line), f"not a protocol reply: {line[:120]!r}"

    def check_bystanders(self) -> None:
        """The server still serves, and the victim's lock was not touched."""
        assert self.server.proc.poll() is None, "dflockd died"
        assert self.checker.req("ping") == "ok"
        renewed = self.victim.req("n", VICTIM_KEY, f"{self.victim_token} {VICTIM_LEASE_S}")
        assert renewed == f"ok {VICTIM_LEASE_S}"
        self.healthy.check()
        if self.phases is not None and self.examples % INTERLUDE_EVERY == 0:
            self.phases.quiet(INTERLUDE_MIN)


def _target(secret: str | None) -> Iterator[Target]:
    args = ["--auth-token", secret] if secret is not None else []
    with dflockd(*args) as server:
        address = server.address
        with (
            HealthyClient(address, key=HEALTHY_KEY, secret=secret) as healthy,
            open_wire(address, secret) as victim,
            open_wire(address, secret) as checker,
        ):
            token = victim.lock(VICTIM_KEY, lease=VICTIM_LEASE_S)
            yield Target(server, healthy, server.rss_kib(), victim, token, checker, secret)


@pytest.fixture(scope="module")
def plain() -> Iterator[Target]:
    """A server without a secret: every byte reaches the request parser."""
    yield from _target(None)


@pytest.fixture(scope="module")
def authed() -> Iterator[Target]:
    """A server with a secret: the fuzz meets the auth gate."""
    yield from _target(SECRET)


def fuzz_settings(short: int, long: int) -> settings:
    """Examples per batch from the suite's scale; network round trips make examples slow."""
    return settings(
        max_examples=scaled(short, long),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


def _fuzz(target: Target, run: Callable[[], None], report: FaultReport, fault: str) -> None:
    """Run the hypothesis test ``run`` and judge the server and the healthy client."""
    examples, requests = target.examples, target.requests
    phases = target.phases = Phases(target.healthy)
    phases.quiet_interlude()  # the examples are the abuse, with quiet interludes between
    try:
        with RssWatch(target.server.pid) as rss, phases.abuse():
            # Another batch of examples until the healthy client has enough cycles under
            # them (fast examples may leave too few for a p99).
            for _ in range(MAX_BATCHES):
                run_abuser(run, FUZZ_RUN_TIMEOUT_S)
                if phases.abuse_count() >= ABUSE_SAMPLES:
                    break
    finally:
        target.phases = None
    phases.quiet(max(INTERLUDE_MIN, MIN_P99_SAMPLES - phases.quiet_count()))
    quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
    examples, requests = target.examples - examples, target.requests - requests
    target.server.assert_healthy()
    wait_for_connections(target.server.address, CONNECTIONS_BESIDES_ABUSE, secret=target.secret)
    stats = server_stats(target.server.address, target.secret)
    # Every fuzz connection is gone, and so is everything it held or waited for.
    assert {entry["key"] for entry in stats["locks"]} <= {VICTIM_KEY, HEALTHY_KEY}, stats
    assert all(entry["waiters"] == 0 for entry in stats["locks"]), stats
    assert stats["semaphores"] == [], stats
    judge_abuse(
        report,
        fault,
        runs=examples,
        operations=requests + 2 * len(under),
        quiet=quiet,
        under=under,
        baseline_kib=target.baseline_rss_kib,
        rss=rss,
        after_kib=target.server.rss_kib(),
        bound_kib=rss_bound_kib(target.baseline_rss_kib, 1),
        p99_floor_ms=0.0,  # acceptance 3 names fuzzing: 10x the quiet p99, no floor
        details=(
            f"{examples} examples, {requests} requests (at most); server up, no error logged, "
            "victim lock renewed after every example, nothing left held"
        ),
    )


# ---------------------------------------------------------------------- the tests
def test_random_bytes(plain: Target, fault_report: FaultReport) -> None:
    @fuzz_settings(200, 1500)
    @given(random_streams.flatmap(cut))
    def example(pieces: list[bytes]) -> None:
        plain.check_replies(*plain.send(pieces))
        plain.check_bystanders()

    _fuzz(plain, example, fault_report, "protocol fuzzing: random bytes")


def test_near_valid_requests(plain: Target, fault_report: FaultReport) -> None:
    @fuzz_settings(200, 1500)
    @given(near_valid_streams().map(b"".join).flatmap(cut))
    def example(pieces: list[bytes]) -> None:
        plain.check_replies(*plain.send(pieces))
        plain.check_bystanders()

    _fuzz(plain, example, fault_report, "protocol fuzzing: near-valid requests")


def test_interleaved_auth(authed: Target, fault_report: FaultReport) -> None:
    secret = SECRET.encode()
    correct = b"auth\n_\n" + secret + b"\n"

    @fuzz_settings(150, 1000)
    @given(st.integers(min_value=0, max_value=3), near_valid_streams(secret), st.data())
    def example(start: int, requests: list[bytes], data: st.DataObject) -> None:
        first_auth = start > 0  # three in four examples authenticate first
        stream = (correct if first_auth else b"") + b"".join(requests)
        lines, closed = authed.send(data.draw(cut(stream)))
        authed.check_replies(lines, closed)
        if first_auth:
            assert lines[:1] == [b"ok"]
        if lines[:1] != [b"ok"]:
            # Not authenticated: one refusal at most, then the close.
            assert lines in ([], [b"error_auth"], [b"error"]), lines[:5]
        if secret not in stream:
            assert b"ok" not in lines and not any(line.startswith(b"ok ") for line in lines)
        authed.check_bystanders()

    _fuzz(authed, example, fault_report, "protocol fuzzing: requests with interleaved auth")
