"""Senders whose reads keep ending mid-request: the fragment delay (constants.py).

A connection whose second read in a row completes no request is not read again for a while;
the delays double while it keeps dripping and start over once a request completes. These tests
make the delays long (seconds) so that "answered without a delay" and "answered after the
delay" are told apart by margins of a second or more, never by a tight clock. The effect on
other clients under a thousand drippers is measured in tests/faults (slowloris).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from dflockd_server import Config, constants as c
from dflockd_server.net import Server
from dflockd_server.testing import ServerThread
from tests.support.waiting import wait_until
from tests.support.wire import Wire

FIRST_DELAY_S = 1.0
"""The first fragment delay in these tests: at least 0.5 s once jittered."""
DEADLINE_S = 10.0


@pytest.fixture
def make_server(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., ServerThread]]:
    """``make(read_timeout_s=...)``: a started server whose fragment delays start at
    ``FIRST_DELAY_S``."""
    monkeypatch.setattr(c, "FRAGMENT_READ_DELAY_S", FIRST_DELAY_S)
    monkeypatch.setattr(c, "FRAGMENT_READ_DELAY_MAX_S", 4 * FIRST_DELAY_S)
    started: list[ServerThread] = []

    def make(read_timeout_s: float = c.DEFAULT_READ_TIMEOUT_S) -> ServerThread:
        config = Config(
            host="127.0.0.1", port=0, shutdown_timeout_s=1, read_timeout_s=read_timeout_s
        )
        server = ServerThread(config, loop_factory=loop_factory)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.stop()


def _delayed(srv: ServerThread) -> int:
    """How many of the server's connections are waiting out a fragment delay."""
    return srv.call(
        lambda: sum(conn.stream.read_delayed for conn in srv.server.admission.connections)
    )


def _fragment_delays(srv: ServerThread) -> list[int]:
    """Each connection's fragment delays since it last completed a request."""
    return srv.call(
        lambda: [conn.stream.fragment_delays for conn in srv.server.admission.connections]
    )


def _wait_buffered(srv: ServerThread, size: int) -> None:
    """Until one of the server's connections holds ``size`` bytes of an unfinished request."""
    wait_until(
        lambda: (
            size
            in srv.call(
                lambda: [c.stream.framer.buffered() for c in srv.server.admission.connections]
            )
        ),
        what=f"a connection holding {size} unread byte(s)",
    )


def _count_delays(srv: ServerThread, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The earlier-delay counts of the fragment delays ``srv`` starts from now on, one per
    delay (its connections ask the server for each delay's length as they start it)."""
    started: list[int] = []
    real = srv.server.fragment_delay

    def counted(earlier: int) -> float:
        started.append(earlier)
        return real(earlier)

    monkeypatch.setattr(srv.server, "fragment_delay", counted)
    return started


def _drip_two_fragments(srv: ServerThread, wire: Wire, first: bytes, second: bytes) -> float:
    """Send two fragments as two reads, the second leaving the request unfinished; return
    when the second was sent, once the server has started its delay."""
    wire.send_raw(first)
    _wait_buffered(srv, len(first))  # read on its own: unfinished, but only the first read
    assert _delayed(srv) == 0
    sent = time.monotonic()
    wire.send_raw(second)
    wait_until(lambda: _delayed(srv) == 1, what="the fragment delay")
    return sent


def test_a_request_in_two_reads_is_answered_without_delay(
    make_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = make_server()
    # No delay is told by the server starting none, not by the reply's round trip being
    # shorter than the shortest delay (0.5 s): a loaded CI machine can take that long.
    delays = _count_delays(srv, monkeypatch)
    with Wire(srv.address) as w:
        for _ in range(3):
            w.send_raw(b"l\nsplit")
            _wait_buffered(srv, len(b"l\nsplit"))
            w.send_raw(b"-key\n0\n")  # completes the request: no delay
            token = w.recv().split()[1]
            assert delays == []
            assert (_delayed(srv), _fragment_delays(srv)) == (0, [0])
            assert w.req("r", "split-key", token) == "ok"
        assert _delayed(srv) == 0
    assert delays == []


def test_a_dripping_sender_is_read_again_only_after_the_delay(
    make_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = make_server()
    delays = _count_delays(srv, monkeypatch)
    with Wire(srv.address) as dripper, Wire(srv.address) as other:
        sent = _drip_two_fragments(srv, dripper, b"p", b"i")
        dripper.send_raw(b"ng\n_\n_\n")  # whole now, but unread until the delay is over
        assert other.req("ping") == "ok"  # other connections are read as usual meanwhile
        assert other.lock("k")
        assert dripper.recv() == "ok"
        assert time.monotonic() - sent >= FIRST_DELAY_S / 2
        assert delays == [0]  # one delay, the first of its run
        assert _delayed(srv) == 0
        # A completed request starts the delays over, and whole requests are not delayed: told
        # by the delays the server started (none more) and the count it keeps (back to 0),
        # not by a round trip shorter than 0.5 s, which a loaded CI machine may not give.
        assert _fragment_delays(srv) == [0, 0]
        assert dripper.req("ping") == "ok"
        assert delays == [0]
        assert (_delayed(srv), _fragment_delays(srv)) == (0, [0, 0])


def test_delays_double_while_the_sender_keeps_dripping(
    make_server: Callable[..., ServerThread],
) -> None:
    srv = make_server()
    with Wire(srv.address) as dripper:
        _drip_two_fragments(srv, dripper, b"p", b"i")
        dripper.send_raw(b"n")  # read after the first delay: still unfinished, delayed again
        wait_until(lambda: _fragment_delays(srv) == [2], what="the second delay")
        dripper.send_raw(b"g\n_\n_\n")
        assert dripper.recv() == "ok"
        assert _fragment_delays(srv) == [0]


def test_fragment_delay_doubles_up_to_its_cap_with_jitter() -> None:
    server = Server(Config(read_timeout_s=2.0))  # cap: a quarter of the read timeout
    cap = 0.5
    for earlier in range(40):
        expected = min(c.FRAGMENT_READ_DELAY_S * 2**earlier, cap)
        delays = [server.fragment_delay(earlier) for _ in range(50)]
        assert all(0.5 * expected <= d <= 1.5 * expected for d in delays), (earlier, delays)
        assert len(set(delays)) > 1  # jittered
    assert server.longest_fragment_delay == 1.5 * cap
    unbounded = Server(Config(read_timeout_s=0))  # no read timeout: the constant's cap
    assert unbounded.longest_fragment_delay == 1.5 * c.FRAGMENT_READ_DELAY_MAX_S


def test_a_silent_dripper_is_still_dropped_by_the_read_timeout(
    make_server: Callable[..., ServerThread],
) -> None:
    # Read timeout 2 s: fragment delays capped at 0.5 s (0.25-0.75 s jittered).
    srv = make_server(read_timeout_s=2.0)
    with Wire(srv.address) as dripper, Wire(srv.address) as other:
        for byte in b"l\nkey\n1":  # a byte every 0.25 s: longer in all than the read timeout
            dripper.send_raw(bytes([byte]))
            assert other.req("ping") == "ok"  # keeps `other` from idling out
            time.sleep(0.25)
        dripper.send_raw(b"0\n")  # the dripped request is answered
        assert dripper.recv().startswith("ok ")
        dripper.send_raw(b"l\nunfinished")
        time.sleep(0.1)
        last_byte = time.monotonic()
        dripper.send_raw(b"-key")  # and silence, mid-request
        assert dripper.closed_by_server()
        assert time.monotonic() - last_byte < 2.0 + 0.75 + DEADLINE_S / 2
